# cmake -DPROGRAM=meshrun-conformance -DPLUGIN=FILE -DEXPECTED=REGEX -P expect_failure.cmake
#
# Passes when the suite fails on PLUGIN with an exit status (a crash is not
# the failure we expect) and its output matches EXPECTED, so a defective
# plugin is refused for the right reason.
execute_process(COMMAND "${PROGRAM}" --plugin "${PLUGIN}"
  RESULT_VARIABLE status OUTPUT_VARIABLE output ERROR_VARIABLE output)
message("${output}")
if(NOT status MATCHES "^[0-9]+$")
  message(FATAL_ERROR "meshrun-conformance did not exit normally on ${PLUGIN}: ${status}")
endif()
if(status EQUAL 0)
  message(FATAL_ERROR "meshrun-conformance passed ${PLUGIN}, which it must refuse")
endif()
# Catch2 wraps long lines, so the words of EXPECTED may be split by any
# white space.
string(REPLACE " " "[ \t\n]+" pattern "${EXPECTED}")
if(NOT output MATCHES "${pattern}")
  message(FATAL_ERROR "meshrun-conformance refused ${PLUGIN} but its output lacks '${EXPECTED}'")
endif()
