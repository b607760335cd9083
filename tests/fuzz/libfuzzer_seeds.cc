// With libFuzzer: writes the target's seeds (FuzzSeeds) into the corpus
// directory named first on its command line before libFuzzer reads it, so
// every run starts from them (the checked-in regression inputs come as a
// second directory).
#include <filesystem>
#include <fstream>
#include <string>

#include "fuzz_seeds.h"

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  for (int i = 1; i < *argc; ++i) {
    std::string arg = (*argv)[i];
    if (arg.empty() || arg[0] == '-') continue;
    std::filesystem::create_directories(arg);
    int n = 0;
    for (const std::string& seed : FuzzSeeds()) {
      std::ofstream out(
          std::filesystem::path(arg) / ("seed-" + std::to_string(n++)),
          std::ios::binary);
      out << seed;
    }
    break;
  }
  return 0;
}
