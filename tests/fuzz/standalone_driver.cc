// Runs a libFuzzer target without libFuzzer (for compilers other than
// clang): its seeds, then a fixed number of deterministic mutations of them
// (byte flips, truncations, insertions, splices). Usage:
//   <target> [iterations]     (default 20000)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "fuzz_seeds.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

void Run(const std::string& input) {
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()),
                         input.size());
}

std::string Mutate(std::string s, const std::vector<std::string>& seeds,
                   std::mt19937_64& rng) {
  int steps = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < steps; ++i) {
    switch (rng() % 5) {
      case 0:
        if (!s.empty())
          s[rng() % s.size()] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1:
        if (!s.empty()) s.resize(rng() % s.size());
        break;
      case 2:
        s.insert(s.begin() + (s.empty() ? 0 : rng() % s.size()),
                 static_cast<char>(rng()));
        break;
      case 3:
        if (!s.empty()) s[rng() % s.size()] = static_cast<char>(rng());
        break;
      default: {
        const std::string& other = seeds[rng() % seeds.size()];
        if (!other.empty()) s += other.substr(rng() % other.size());
      }
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  long iterations = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 20000;
  std::vector<std::string> seeds = FuzzSeeds();
  for (const std::string& s : seeds) Run(s);
  std::mt19937_64 rng(12345);
  for (long i = 0; i < iterations; ++i) {
    Run(Mutate(seeds[rng() % seeds.size()], seeds, rng));
  }
  std::printf("%zu seeds and %ld mutations ran cleanly\n", seeds.size(),
              iterations);
  return 0;
}
