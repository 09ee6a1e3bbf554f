// Compiles tests/support/test_pch.h once for every test executable (tests/CMakeLists.txt); the
// program itself does nothing.
int main() {
  return 0;
}
