# Proves that a test which cannot run is reported as skipped, and that under CI=true only a
# missing GPU may skip. Run by ctest as `cmake -DREAL_TEST=... -DSELFTEST=... -DBINARY_DIR=...
# -P skip_check.cmake`; fails naming the first expectation that does not hold.
#   REAL_TEST: refworker_engine_tests, whose loader case needs the stories260K checkpoint.
#   SELFTEST:  kvrelay_skip_selftest (support/skip_selftest.cpp).

set(model_case "refworker loader: identity is the xxh3 of the checkpoint bytes")
set(missing_model "${BINARY_DIR}/no-such-dir/stories260K.bin")

# expect(NAME CODE <exit code> [OUTPUT <regex>] COMMAND ...): runs COMMAND with a clean CI.
function(expect name)
  cmake_parse_arguments(ARG "" "CODE;OUTPUT" "COMMAND" ${ARGN})
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=CI ${ARG_COMMAND}
                  RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT code STREQUAL ARG_CODE)
    message(FATAL_ERROR "${name}: exit ${code}, expected ${ARG_CODE}\n${out}\n${err}")
  endif()
  if(ARG_OUTPUT AND NOT out MATCHES "${ARG_OUTPUT}")
    message(FATAL_ERROR "${name}: output lacks /${ARG_OUTPUT}/\n${out}\n${err}")
  endif()
  message(STATUS "${name}: exit ${code} as expected")
endfunction()

expect("no checkpoint: the model test skips" CODE 77 OUTPUT "skipped: stories260K.bin not found"
       COMMAND ${CMAKE_COMMAND} -E env KVRELAY_TEST_MODEL=${missing_model} ${REAL_TEST} ${model_case})
expect("no checkpoint under CI=true: the model test fails" CODE 1 OUTPUT "cannot skip under CI=true"
       COMMAND ${CMAKE_COMMAND} -E env CI=true KVRELAY_TEST_MODEL=${missing_model} ${REAL_TEST} ${model_case})
expect("no GPU under CI=true: still a skip" CODE 77 OUTPUT "skipped: the selftest has no GPU"
       COMMAND ${CMAKE_COMMAND} -E env CI=true ${SELFTEST} "skip selftest: no GPU")
expect("one case skips, one passes: skipped" CODE 77
       COMMAND ${SELFTEST} "skip selftest: no GPU,skip selftest: passes")
expect("one case skips, one fails: failed" CODE 1
       COMMAND ${SELFTEST} "skip selftest: no GPU,skip selftest: fails")
expect("nothing skips: passed" CODE 0 COMMAND ${SELFTEST} "skip selftest: passes")

# ctest itself, through the registration kvrelay_add_test made: skipped, not passed. A scratch
# test directory that includes only that registration keeps this ctest's logs out of the build's.
file(GLOB registration "${BINARY_DIR}/tests/refworker/refworker_engine_tests_include*.cmake")
if(NOT registration)
  message(FATAL_ERROR "no ctest registration of refworker_engine_tests under ${BINARY_DIR}/tests/refworker")
endif()
set(scratch "${BINARY_DIR}/test-tmp/skip-check")
file(REMOVE_RECURSE "${scratch}")
file(MAKE_DIRECTORY "${scratch}")
list(GET registration 0 registration)
file(WRITE "${scratch}/CTestTestfile.cmake" "include(\"${registration}\")\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=CI KVRELAY_TEST_MODEL=${missing_model}
                        ${CMAKE_CTEST_COMMAND} --test-dir ${scratch} -R "^${model_case}$"
                RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
file(REMOVE_RECURSE "${scratch}")
if(NOT code EQUAL 0 OR NOT out MATCHES "\\*\\*\\*Skipped" OR NOT out MATCHES "out of 1\n")
  message(FATAL_ERROR "ctest did not report the model test as skipped (exit ${code}):\n${out}\n${err}")
endif()
message(STATUS "ctest reports the model test as skipped")
