// cuBLAS is loaded on first use, not at start (cuda_layers.h, cublas_loads): a process that
// links the GPU model but never makes one does not carry cuBLAS's libraries (about 210 MB of
// resident memory). Runs on every CUDA build, GPU or not: loading needs the library, not a GPU.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "zinf/gpt/cuda_layers.h"

namespace zinf::gpt::cuda {
namespace {

bool mapped(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::stringstream text;
  text << maps.rdbuf();
  return text.str().find(library) != std::string::npos;
}

TEST(Cublas, IsLoadedOnFirstUseOnly) {
  EXPECT_FALSE(mapped("libcublas")) << "cuBLAS was loaded at start";
  std::string error;
  ASSERT_TRUE(cublas_loads(&error)) << error;
  EXPECT_TRUE(error.empty()) << error;
  EXPECT_TRUE(mapped("libcublas.so")) << "cublas_loads reported success without loading it";
  EXPECT_TRUE(cublas_loads(&error)) << "a second call reuses the first load";
}

}  // namespace
}  // namespace zinf::gpt::cuda
