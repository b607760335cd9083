# Runs protoc-gen-rdmarpc on PROTO and checks that it fails with EXPECT in
# its error output: failing for any other reason fails the test.
#
#   cmake -DPROTOC=... -DPLUGIN=... -DPROTO_DIR=<dir of rdmarpc/tensor.proto>
#         -DPROTO_ROOT=<import root> -DPROTO=<file relative to the root>
#         -DOUT_DIR=<scratch dir> "-DEXPECT=<phrase>" -P check_error.cmake
file(REMOVE_RECURSE "${OUT_DIR}")
file(MAKE_DIRECTORY "${OUT_DIR}")
execute_process(
  COMMAND "${PROTOC}" "-I${PROTO_ROOT}" "-I${PROTO_DIR}"
          "--plugin=protoc-gen-rdmarpc=${PLUGIN}" "--rdmarpc_out=${OUT_DIR}"
          "${PROTO_ROOT}/${PROTO}"
  RESULT_VARIABLE rc
  ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "protoc accepted ${PROTO}; expected it to fail with:\n"
                      "  ${EXPECT}")
endif()
string(FIND "${err}" "${EXPECT}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "protoc failed on ${PROTO} (${rc}), but its error "
                      "output lacks\n  ${EXPECT}\nIt was:\n${err}")
endif()
