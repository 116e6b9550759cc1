# Runs a tool's command line and checks its exit code and what it printed to stderr:
#   cmake -DCMD=<exe;arg;...> -DEXPECT_RC=<n> -DEXPECT_STDERR=<regex> [-DEXPECT_STDOUT=<regex>]
#         -P expect_exit.cmake
execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT 60)
if(NOT rc STREQUAL EXPECT_RC)
  message(FATAL_ERROR "${CMD}: exit code ${rc}, expected ${EXPECT_RC}\nstdout:\n${out}\n"
                      "stderr:\n${err}")
endif()
if(DEFINED EXPECT_STDERR AND NOT err MATCHES "${EXPECT_STDERR}")
  message(FATAL_ERROR "${CMD}: stderr does not match '${EXPECT_STDERR}':\n${err}")
endif()
if(DEFINED EXPECT_STDOUT AND NOT out MATCHES "${EXPECT_STDOUT}")
  message(FATAL_ERROR "${CMD}: stdout does not match '${EXPECT_STDOUT}':\n${out}")
endif()
message("${CMD}: exit ${rc}, stderr: ${err}")
