# Runs protoc-gen-rdmarpc on PROTO and compares its output with the
# checked-in PROTO_ROOT/<stem>.rdmarpc.pb.{h,cc}.golden files.
#
#   cmake -DPROTOC=... -DPLUGIN=... -DPROTO_DIR=<dir of rdmarpc/tensor.proto>
#         -DPROTO_ROOT=<import root> -DPROTO=<file relative to the root>
#         -DOUT_DIR=<scratch dir> -DREGENERATE=<script> -P check_golden.cmake
file(REMOVE_RECURSE "${OUT_DIR}")
file(MAKE_DIRECTORY "${OUT_DIR}")
execute_process(
  COMMAND "${PROTOC}" "-I${PROTO_ROOT}" "-I${PROTO_DIR}"
          "--plugin=protoc-gen-rdmarpc=${PLUGIN}" "--rdmarpc_out=${OUT_DIR}"
          "${PROTO_ROOT}/${PROTO}"
  RESULT_VARIABLE rc
  ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "protoc failed on ${PROTO} (${rc}):\n${err}")
endif()

string(REGEX REPLACE "\\.proto$" "" stem "${PROTO}")
find_program(DIFF diff)
set(mismatch FALSE)
foreach(ext IN ITEMS h cc)
  set(expected "${PROTO_ROOT}/${stem}.rdmarpc.pb.${ext}.golden")
  set(actual "${OUT_DIR}/${stem}.rdmarpc.pb.${ext}")
  execute_process(COMMAND "${CMAKE_COMMAND}" -E compare_files
                          "${expected}" "${actual}"
                  RESULT_VARIABLE differs)
  if(differs)
    set(mismatch TRUE)
    if(DIFF)
      execute_process(COMMAND "${DIFF}" -u "${expected}" "${actual}")
    else()
      message("${actual} differs from ${expected}")
    endif()
  endif()
endforeach()
if(mismatch)
  message(FATAL_ERROR
    "The generated code differs from the golden files (diff above). If the "
    "change is intended, update them with:\n"
    "  PROTOC=${PROTOC} ${REGENERATE} ${PLUGIN}")
endif()
