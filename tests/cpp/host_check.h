// The plain host tests' check (test_bwd_abi, test_fp8_layout, test_varlen_span): a failed CHECK
// prints its message and counts; main returns host_check_exit(), which prints "OK" (what
// tests/test_host_cpp.py looks for) or the count. The schedule tests keep their own CHECK: it
// also names the problem being simulated and can be silenced for negative controls.
#pragma once

#include <cstdio>

static int failures = 0;
#define CHECK(cond, ...)                 \
  do {                                   \
    if (!(cond)) {                       \
      std::printf("FAIL: " __VA_ARGS__); \
      std::printf("\n");                 \
      ++failures;                        \
    }                                    \
  } while (0)

static inline int host_check_exit() {
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
