// Sixteen float32 lanes: one column of a 16-row weight panel, and the accumulators it feeds. One 512-bit
// register where the CPU has AVX-512 (which also does twice the multiply-adds per instruction, and on the
// CPUs with full-width units twice per cycle), two 256-bit ones with AVX2 and FMA. The panel kernels
// (panel_linear.cpp, fused_moe.cpp) are written once over this type; PAGEDSERVE_VEC16 is undefined where
// neither instruction set is there, and they fall back to portable loops.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace pagedserve {

// Calls f(std::integral_constant<int, R>{}) for the R in [1, N] equal to `rows` (nothing for another): a
// runtime count of rows of x to the kernel instance templated on it.
template <typename F, int... R>
inline void with_rows(int rows, const F& f, std::integer_sequence<int, R...>) {
  ((rows == R + 1 ? f(std::integral_constant<int, R + 1>{}) : void()), ...);
}

template <int N, typename F>
inline void with_rows(int rows, const F& f) {
  with_rows(rows, f, std::make_integer_sequence<int, N>{});
}

// float32 -> bfloat16 bits, rounded to nearest even (finite values, as torch rounds them).
inline uint16_t to_bfloat16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

}  // namespace pagedserve

// GCC keeps arrays of vector accumulators in registers only when the loops over them are unrolled in full;
// otherwise it stores every accumulator to the stack after each FMA (half the speed).
#define PAGEDSERVE_UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PAGEDSERVE_VEC16 1

namespace pagedserve {

#if defined(__AVX512F__)
struct Vec16 {
  __m512 v;
  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 broadcast(const float* p) { return {_mm512_set1_ps(*p)}; }
  // 16 int8 lanes, widened.
  static Vec16 from_int8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  // 16 bytes: `low` their low nibbles, `high` their high ones.
  static void from_nibbles(const uint8_t* p, Vec16& low, Vec16& high) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    low = {_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)))};
    high = {_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))};
  }
  // 16 pairs of bfloat16 (32 values, row j's pair at 2 j): `even` the first of each pair, `odd` the second.
  static void from_bf16_pairs(const uint16_t* p, Vec16& even, Vec16& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
    odd = {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  friend Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
};
// Rows of x per float32 tile: accumulators for 12 rows + 1 weight + broadcasts of 32 registers.
constexpr int64_t kVec16TileRows = 12;
#else
struct Vec16 {
  __m256 lo, hi;
  static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec16 broadcast(const float* p) {
    const __m256 b = _mm256_broadcast_ss(p);
    return {b, b};
  }
  static Vec16 from_int8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
  }
  static void from_nibbles(const uint8_t* p, Vec16& low, Vec16& high) {
    const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    low = {_mm256_cvtepi32_ps(_mm256_and_si256(v0, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(v1, mask))};
    high = {_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4))};
  }
  static void from_bf16_pairs(const uint16_t* p, Vec16& even, Vec16& odd) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16))};
    odd = {_mm256_castsi256_ps(_mm256_and_si256(v0, high)), _mm256_castsi256_ps(_mm256_and_si256(v1, high))};
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  friend Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  friend Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  friend Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
};
// Rows of x per float32 tile: 12 accumulators + 2 weights + 1 broadcast of 16 registers.
constexpr int64_t kVec16TileRows = 6;
#endif

}  // namespace pagedserve
#endif
