// Seed inputs a fuzz target offers its standalone driver.
#ifndef RDMARPC_TESTS_FUZZ_FUZZ_SEEDS_H_
#define RDMARPC_TESTS_FUZZ_FUZZ_SEEDS_H_

#include <string>
#include <vector>

std::vector<std::string> FuzzSeeds();

#endif  // RDMARPC_TESTS_FUZZ_FUZZ_SEEDS_H_
