# Locate the CUTLASS/CuTe headers. Nothing of CUTLASS is committed to this repository.
#
# Order: -DCUTLASS_DIR=<root> or the CUTLASS_DIR environment variable (a CUTLASS checkout or any
# folder with include/cute), then the nvidia-cutlass wheel importable by the Python that runs the
# build (scikit-build-core puts it in the isolated build environment via build-system.requires).
# Defines the interface target cutlass::headers.

set(_fh_cutlass_candidates "")
if(CUTLASS_DIR)
  list(APPEND _fh_cutlass_candidates "${CUTLASS_DIR}")
elseif(DEFINED ENV{CUTLASS_DIR})
  list(APPEND _fh_cutlass_candidates "$ENV{CUTLASS_DIR}")
else()
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
        "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))"
      OUTPUT_VARIABLE _fh_wheel_root OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _fh_rc ERROR_QUIET)
    if(_fh_rc EQUAL 0)
      list(APPEND _fh_cutlass_candidates "${_fh_wheel_root}")
    endif()
  endif()
endif()

set(FH_CUTLASS_INCLUDE "")
foreach(_root IN LISTS _fh_cutlass_candidates)
  if(EXISTS "${_root}/include/cute/tensor.hpp")
    set(FH_CUTLASS_INCLUDE "${_root}/include")
    break()
  endif()
endforeach()

if(NOT FH_CUTLASS_INCLUDE)
  message(FATAL_ERROR
    "CUTLASS headers not found (looked in: '${_fh_cutlass_candidates}'). Install the pinned wheel "
    "(pip install nvidia-cutlass==4.2.0.0) into the Python running the build, or point "
    "-DCUTLASS_DIR / the CUTLASS_DIR environment variable at a CUTLASS checkout.")
endif()
message(STATUS "flash-hopper: CUTLASS headers at ${FH_CUTLASS_INCLUDE}")

add_library(fh_cutlass_headers INTERFACE)
# SYSTEM: CUTLASS's own warnings are not ours to fix.
target_include_directories(fh_cutlass_headers SYSTEM INTERFACE "${FH_CUTLASS_INCLUDE}")
add_library(cutlass::headers ALIAS fh_cutlass_headers)
