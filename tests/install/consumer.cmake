# cmake --install, then build and run examples/consumer with find_package(zinf).
set(prefix ${BUILD_DIR}/install-test)
set(consumer ${BUILD_DIR}/consumer-test)
file(REMOVE_RECURSE ${prefix} ${consumer})
foreach(step
    "${CMAKE_COMMAND};--install;${BUILD_DIR};--prefix;${prefix}"
    "${CMAKE_COMMAND};-S;${SOURCE_DIR}/examples/consumer;-B;${consumer};-G;Ninja;-DCMAKE_PREFIX_PATH=${prefix}"
    "${CMAKE_COMMAND};--build;${consumer}"
    "${consumer}/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${step}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endforeach()
