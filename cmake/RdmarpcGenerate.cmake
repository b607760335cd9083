# rdmarpc_generate(): generate and compile rdmarpc stubs for .proto files.
#
#   rdmarpc_generate(TARGET my_app PROTOS proto/demo.proto
#                    [PROTO_ROOT proto] [IMPORT_DIRS dir...])
#
# Runs protoc with --cpp_out and protoc-gen-rdmarpc on each file, adds the
# generated x.pb.cc and x.rdmarpc.pb.cc to TARGET, puts their folder on
# TARGET's include path and links TARGET with rdmarpc. PROTO_ROOT (default:
# the folder of the first proto) is the import root the files are named
# relative to; rdmarpc/tensor.proto is always importable.
#
# Needs: RDMARPC_PROTOC_GEN (path to the plugin), RDMARPC_PROTO_DIR (the
# folder holding rdmarpc/tensor.proto) and RDMARPC_LIBRARY (target to link);
# rdmarpcConfig.cmake or the rdmarpc build set them.
function(rdmarpc_generate)
  cmake_parse_arguments(ARG "" "TARGET;PROTO_ROOT" "PROTOS;IMPORT_DIRS" ${ARGN})
  if(NOT ARG_TARGET OR NOT ARG_PROTOS)
    message(FATAL_ERROR "rdmarpc_generate: TARGET and PROTOS are required")
  endif()
  set(out_dir "${CMAKE_CURRENT_BINARY_DIR}/rdmarpc_gen/${ARG_TARGET}")
  if(ARG_PROTO_ROOT)
    get_filename_component(root "${ARG_PROTO_ROOT}" ABSOLUTE)
  else()
    list(GET ARG_PROTOS 0 first)
    get_filename_component(first "${first}" ABSOLUTE)
    get_filename_component(root "${first}" DIRECTORY)
  endif()
  set(import_args "-I${root}")
  foreach(dir IN LISTS ARG_IMPORT_DIRS)
    get_filename_component(dir "${dir}" ABSOLUTE)
    list(APPEND import_args "-I${dir}")
  endforeach()
  list(APPEND import_args "-I${RDMARPC_PROTO_DIR}")
  if(Protobuf_INCLUDE_DIRS)
    list(GET Protobuf_INCLUDE_DIRS 0 pb_inc)
    list(APPEND import_args "-I${pb_inc}")
  endif()
  set(sources)
  foreach(proto IN LISTS ARG_PROTOS)
    get_filename_component(abs "${proto}" ABSOLUTE)
    file(RELATIVE_PATH rel "${root}" "${abs}")
    if(rel MATCHES "^\\.\\.")
      message(FATAL_ERROR "rdmarpc_generate: ${proto} is not under PROTO_ROOT ${root}")
    endif()
    string(REGEX REPLACE "\\.proto$" "" stem "${rel}")
    set(outs "${out_dir}/${stem}.pb.h" "${out_dir}/${stem}.pb.cc"
             "${out_dir}/${stem}.rdmarpc.pb.h" "${out_dir}/${stem}.rdmarpc.pb.cc")
    add_custom_command(
      OUTPUT ${outs}
      COMMAND ${CMAKE_COMMAND} -E make_directory "${out_dir}"
      COMMAND protobuf::protoc ${import_args} "--cpp_out=${out_dir}"
              "--plugin=protoc-gen-rdmarpc=${RDMARPC_PROTOC_GEN}"
              "--rdmarpc_out=${out_dir}" "${abs}"
      DEPENDS "${abs}" protobuf::protoc ${RDMARPC_PROTOC_GEN_DEPENDS}
      COMMENT "rdmarpc: generating stubs for ${rel}"
      VERBATIM)
    list(APPEND sources ${outs})
  endforeach()
  target_sources(${ARG_TARGET} PRIVATE ${sources})
  target_include_directories(${ARG_TARGET} PUBLIC "$<BUILD_INTERFACE:${out_dir}>")
  target_link_libraries(${ARG_TARGET} PUBLIC ${RDMARPC_LIBRARY})
endfunction()
