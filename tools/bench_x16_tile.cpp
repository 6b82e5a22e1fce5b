// The AVX2 x16 product's tile alone (tools/bench_x16_tile.py compiles this file with the
// package's headers, or modified copies of them found first, and a generated list of the
// (type, passes) instances to time: LLMD_TILE_CASES). Single-threaded: one sweep is
// `groups` 16-row weight groups of K columns against `rows` rows of x in tiles of 4 (as
// for_each_tile walks one thread's share; the tile the product takes for the type and
// passes: any_tile), timed `reps` times, the fastest kept. The
// weight bytes are constant (0x3C: small codes, fp16 scales near 1, no denormals; the
// integer work does not depend on the values) and x's codes are small.
#ifndef CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY_AVX2 1
#endif
#include "cpu_quant_x16_avx2_tiles.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace llmd_x16;

namespace {

template <int Q, int P>
void time_tile(const char* name, int64_t k, int64_t groups, int rows, int reps, double ghz) {
  using R = X16Half<Q>;
  const int64_t blocks = k / kBlock;
  const int64_t records = k / (kBlock * R::kSub);
  const int64_t rec = record_bytes(Q);
  std::vector<uint8_t> w(groups * records * rec, 0x3C);
  std::vector<int8_t> codes(rows * P * k, 3);
  std::vector<int16_t> wide(rows * k, 5);
  std::vector<float> d(rows * blocks, 0.01f), ds(rows * 2 * blocks, 0.5f);
  std::vector<int32_t> sums(rows * P * 2 * blocks, 7), pairs(rows * blocks / 2, 0x00070007);
  std::vector<QuantizedRow> x(rows);
  for (int r = 0; r < rows; ++r)
    x[r] = QuantizedRow{codes.data() + r * P * k, d.data() + r * blocks, ds.data() + r * 2 * blocks,
                        sums.data() + r * P * 2 * blocks, k, blocks, wide.data() + r * k,
                        pairs.data() + r * blocks / 2};
  const int64_t n = groups * kGroup;
  std::vector<float> out(rows * n);
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = w.data() + g * records * rec;
      int r0 = 0;
      for (; r0 + 4 <= rows; r0 += 4) any_tile<Q, 4, P>(wg, x.data() + r0, out.data() + r0 * n + g * kGroup, n);
      for (; r0 < rows; ++r0) any_tile<Q, 1, P>(wg, x.data() + r0, out.data() + r0 * n + g * kGroup, n);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < best) best = s;
  }
  const double macs = static_cast<double>(rows) * n * k;
  std::printf("tile %s %d %ld %ld %d %.4f %.2f %.2f\n", name, P, static_cast<long>(n), static_cast<long>(k), rows,
              best * 1e3, macs / best / 1e9, macs / best / (ghz * 1e9));
}

// Eight independent accumulators, so that each op's latency is hidden and the loop
// measures how many of it (or of the pair) issue per cycle.
#define EIGHT(OP) a0 = OP(a0); a1 = OP(a1); a2 = OP(a2); a3 = OP(a3); a4 = OP(a4); a5 = OP(a5); a6 = OP(a6); a7 = OP(a7);
#define ISSUE_RATE(NAME, OP)                                                                                   \
  {                                                                                                            \
    __m256i a0 = _mm256_set1_epi8(1), a1 = _mm256_set1_epi8(2), a2 = _mm256_set1_epi8(3),                    \
            a3 = _mm256_set1_epi8(4), a4 = _mm256_set1_epi8(5), a5 = _mm256_set1_epi8(6),                    \
            a6 = _mm256_set1_epi8(7), a7 = _mm256_set1_epi8(8);                                              \
    const auto start = std::chrono::steady_clock::now();                                                       \
    for (long i = 0; i < iterations; ++i) { EIGHT(OP) }                                                        \
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();          \
    const __m256i all = _mm256_add_epi8(_mm256_add_epi8(_mm256_add_epi8(a0, a1), _mm256_add_epi8(a2, a3)),     \
                                        _mm256_add_epi8(_mm256_add_epi8(a4, a5), _mm256_add_epi8(a6, a7)));    \
    sink += _mm256_extract_epi32(all, 0);                                                                      \
    std::printf("issue %s %.3f\n", NAME, iterations * 8.0 / s / (ghz * 1e9));                                  \
  }

__attribute__((target("avx2"))) void issue_rates(long iterations, int seed, double ghz) {
  volatile int sink = 0;
  const __m256i b = _mm256_set1_epi8(static_cast<char>(seed)), ones = _mm256_set1_epi16(1);
#define MADDUBS(a) _mm256_maddubs_epi16(a, b)
#define ADDW(a) _mm256_add_epi16(a, b)
#define MADDWD(a) _mm256_madd_epi16(a, ones)
#define MADDUBS_ADDW(a) _mm256_add_epi16(_mm256_maddubs_epi16(a, b), b)
  ISSUE_RATE("vpmaddubsw", MADDUBS)
  ISSUE_RATE("vpaddw", ADDW)
  ISSUE_RATE("vpmaddwd", MADDWD)
  ISSUE_RATE("vpmaddubsw+vpaddw", MADDUBS_ADDW)
}

}  // namespace

// argv: k groups rows reps ghz issue_iterations
int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s K GROUPS ROWS REPS GHZ ISSUE_ITERATIONS\n", argv[0]);
    return 2;
  }
  const int64_t k = std::atoll(argv[1]), groups = std::atoll(argv[2]);
  const int rows = std::atoi(argv[3]), reps = std::atoi(argv[4]);
  const double ghz = std::atof(argv[5]);
  const long issue = std::atol(argv[6]);
#define TILE(NAME, Q, P) time_tile<Q, P>(NAME, k, groups, rows, reps, ghz);
  LLMD_TILE_CASES
  if (issue > 0) issue_rates(issue, argc, ghz);
  return 0;
}
