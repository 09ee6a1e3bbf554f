#pragma once

// Kept for the refworker tests' short include; the macros live in support/skip.h.
#include "support/skip.h"
