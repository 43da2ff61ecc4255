# zinf_library(NAME SOURCES ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
# A library whose public headers live in <dir>/include (included as <zinf/...>).
function(zinf_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} ${ARG_SOURCES})
  add_library(zinf::${name} ALIAS ${name})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:include>)
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  # `cmake --install` puts the library and its headers in the prefix; find_package(zinf) finds
  # them through the zinfTargets export (zinf::<name>, and zinf::zinf for everything).
  install(TARGETS ${name} EXPORT zinfTargets ARCHIVE DESTINATION lib LIBRARY DESTINATION lib)
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/ DESTINATION include)
endfunction()

# zinf_test(NAME SOURCES ... DEPS ... LABELS ...)
# One GoogleTest binary; every TEST in it becomes a ctest test carrying LABELS.
# STRICT: every test also runs on the strict CPU device (ZINF_DEVICE=cpu-strict, names prefixed
# "strict."), whose memory faults on any host access outside the device's operations. (PROPERTIES
# are name/value pairs: a list value would be split, so each value here is a single word.)
function(zinf_test name)
  cmake_parse_arguments(ARG "STRICT" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main GTest::gmock)
  # The CPU device, also on a machine with a GPU (where `auto` would pick CUDA): the GPU's own
  # tests are tests/gpu's.
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60
    PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT} ENVIRONMENT "ZINF_DEVICE=cpu")
  if(ARG_STRICT)
    gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 TEST_PREFIX "strict."
      PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT}
                 ENVIRONMENT "ZINF_DEVICE=cpu-strict")
  endif()
endfunction()

# Every test of the calling directory that names no device runs on the CPU device: with the
# default `auto` a machine with a GPU would otherwise run them on CUDA, against expectations
# written for the CPU (the GPU's own checks are tests/gpu's). Call it last in a tests/ folder
# that uses add_test(); zinf_test() sets the same for the tests gtest discovers.
function(zinf_tests_default_to_cpu)
  get_property(_tests DIRECTORY PROPERTY TESTS)
  foreach(_test ${_tests})
    get_test_property(${_test} ENVIRONMENT _env)
    if(NOT _env MATCHES "ZINF_DEVICE=")
      set_property(TEST ${_test} APPEND PROPERTY ENVIRONMENT "ZINF_DEVICE=cpu")
    endif()
  endforeach()
endfunction()
