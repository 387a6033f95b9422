# The torch-free layers stay torch-free (docs/architecture.md, Layers): launcher/ and
# smp_common/ include nothing of torch or of the folders above them, and their
# CMakeLists compile no file of another folder. Run by ctest as layers_test:
#   cmake -DSMP_SOURCE_DIR=<repo> -P cmake/check_layers.cmake
# A compile alone would not catch an upward include: every target has the repository
# root on its include path, and a header-only use of smp_core/ links.
if(NOT SMP_SOURCE_DIR)
  get_filename_component(SMP_SOURCE_DIR "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
endif()

set(torch_includes "torch/|ATen/|c10/|c10d/|caffe2/|pybind11/")
set(upper_folders "smp_core|partition|hooks|checkpoint|python|include/smp")
# folder -> what its sources may not include.
set(forbidden_launcher "^(${torch_includes}|(${upper_folders})/)")
set(forbidden_smp_common "^(${torch_includes}|(${upper_folders}|launcher)/)")

set(errors "")
foreach(folder launcher smp_common)
  file(GLOB_RECURSE sources "${SMP_SOURCE_DIR}/${folder}/*.h" "${SMP_SOURCE_DIR}/${folder}/*.cpp")
  if(NOT sources)
    string(APPEND errors "  ${folder}/ has no sources (moved? update cmake/check_layers.cmake)\n")
  endif()
  foreach(src IN LISTS sources)
    file(STRINGS "${src}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
    foreach(line IN LISTS lines)
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[<\"]([^>\"]*)[>\"].*$" "\\1" header "${line}")
      if(header MATCHES "${forbidden_${folder}}")
        file(RELATIVE_PATH rel "${SMP_SOURCE_DIR}" "${src}")
        string(APPEND errors "  ${rel} includes <${header}>\n")
      endif()
    endforeach()
  endforeach()
  # Its CMakeLists: no torch, no smp_core, no source of another folder.
  file(STRINGS "${SMP_SOURCE_DIR}/${folder}/CMakeLists.txt" lines)
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "#.*$" "" code "${line}")
    if(code MATCHES "smp_core|[Tt]orch|TORCH|\\.\\./|PROJECT_SOURCE_DIR}/|CMAKE_SOURCE_DIR}/")
      string(STRIP "${code}" code)
      string(APPEND errors "  ${folder}/CMakeLists.txt: ${code}\n")
    endif()
  endforeach()
endforeach()

if(errors)
  message(FATAL_ERROR "smp: a torch-free layer reaches up (docs/architecture.md, Layers):\n"
          "${errors}Move shared torch-free code into smp_common/ instead.")
endif()
message(STATUS "smp: launcher/ and smp_common/ include no torch and no upper layer")
