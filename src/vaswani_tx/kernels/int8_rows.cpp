// int8 products of a few rows for x86 CPUs with AVX512-VNNI: y = x W^T + b for x (M, K) float32 and W (N, K) int8
// with one scale per output row (the weights `quantize_int8` made), the activations quantized per row on the fly.
//
// Why: at a sentence a call (beam search over one source: about 6 rows) each of the decoder's int8 products is a
// few hundred thousand multiply-adds, a microsecond or two of VNNI work, and fbgemm's dynamic quantized linear spends
// some 20 us around it (quantization parameters, packing the activations, requantization). Here the activations are
// quantized in one pass and each 64-byte block of W is read once for every row (vpdpbusd).
//
// Quantization: row m of x gets the symmetric scale s_m = max|x_m| / 127 and q = round(x / s_m) in [-127, 127],
// stored as q + 128 (unsigned, as vpdpbusd multiplies unsigned by signed bytes); the + 128 is taken out with the
// column sums of W: sum_k (q + 128) w = sum_k q w + 128 sum_k w. Then y[m, n] = s_m * ws[n] * acc + b[n].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;   // output columns a zmm register accumulates
constexpr int64_t kGroup = 4;    // bytes of K a vpdpbusd lane multiplies and sums
constexpr int64_t kMaxRows = 8;  // rows whose accumulators stay in registers while a block of W is read
constexpr int64_t kMinWork = 1 << 22;  // multiply-adds a thread takes at least (about 2 us of vpdpbusd)
constexpr int64_t kKeptBytes = 1 << 16;  // a thread's buffer for the quantized rows and their scales

// W (N, K) int8 -> blocks of 16 columns, K padded to a multiple of 4: [N / 16][K / 4][16][4], zeros beyond N and K.
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "int8_rows_pack: W must be (N, K) int8");
  auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t blocks = (n + kLanes - 1) / kLanes, groups = (k + kGroup - 1) / kGroup;
  auto packed = at::zeros({blocks, groups, kLanes, kGroup}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  for (int64_t col = 0; col < n; ++col) {
    const int64_t block = col / kLanes, lane = col % kLanes;
    for (int64_t i = 0; i < k; ++i) {
      dst[((block * groups + i / kGroup) * kLanes + lane) * kGroup + i % kGroup] = src[col * k + i];
    }
  }
  return packed;
}

// The column sums of W times 128 (what the unsigned shift adds to each accumulator), as int32 (N,), a column at a
// time: at most K x 127 x 128 in magnitude, exact in int32. (at::sum over W as int32 made an int32 and an int64 copy
// of all of W first: 228 MB at the base shape's 37,000 x 512, the peak of a greedy process' first call.)
at::Tensor shift_sums(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "int8_rows_shift_sums: W must be (N, K) int8");
  auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  auto sums = at::empty({n}, w.options().dtype(at::kInt));
  const int8_t* src = w.data_ptr<int8_t>();
  int32_t* dst = sums.data_ptr<int32_t>();
  for (int64_t col = 0; col < n; ++col) {
    int32_t sum = 0;
    for (int64_t i = 0; i < k; ++i) sum += src[col * k + i];
    dst[col] = sum * 128;
  }
  return sums;
}

template <int64_t Rows, int64_t Blocks>
void block_rows(const uint8_t* xq, int64_t groups, const int8_t* w, int64_t block_stride, int32_t* out) {
  // out: Blocks x kMaxRows x 16 int32 accumulators of `Blocks` adjacent blocks of 16 columns. Each broadcast of four
  // bytes of a row serves every block: two blocks take one load of x for two vpdpbusd, where one block's loads of x
  // bound the loop (8,000 x 256, one thread, Intel Xeon: 1.07 against 1.39 ms at 128 rows, 2.2 against 4.9 at 256).
  __m512i acc[Blocks][Rows];
  for (int64_t b = 0; b < Blocks; ++b) {
    for (int64_t r = 0; r < Rows; ++r) acc[b][r] = _mm512_setzero_si512();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[Blocks];
    for (int64_t b = 0; b < Blocks; ++b) {
      wv[b] = _mm512_loadu_si512(reinterpret_cast<const void*>(w + b * block_stride + g * kLanes * kGroup));
    }
    for (int64_t r = 0; r < Rows; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * groups * kGroup + g * kGroup, sizeof(four));
      const __m512i xv = _mm512_set1_epi32(four);
      for (int64_t b = 0; b < Blocks; ++b) acc[b][r] = _mm512_dpbusd_epi32(acc[b][r], xv, wv[b]);
    }
  }
  for (int64_t b = 0; b < Blocks; ++b) {
    for (int64_t r = 0; r < Rows; ++r) {
      _mm512_storeu_si512(reinterpret_cast<void*>(out + (b * kMaxRows + r) * kLanes), acc[b][r]);
    }
  }
}

constexpr int64_t kBlocks = 2;  // blocks of columns a call of block_rows takes at most (three spill registers)
using BlockFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int32_t*);
template <int64_t Blocks>
constexpr std::array<BlockFn, kMaxRows + 1> kRowsFns = {
    nullptr,                  block_rows<1, Blocks>, block_rows<2, Blocks>, block_rows<3, Blocks>,
    block_rows<4, Blocks>,    block_rows<5, Blocks>, block_rows<6, Blocks>, block_rows<7, Blocks>,
    block_rows<8, Blocks>};
constexpr std::array<std::array<BlockFn, kMaxRows + 1>, kBlocks + 1> kBlockFns = {
    std::array<BlockFn, kMaxRows + 1>{}, kRowsFns<1>, kRowsFns<2>};

at::Tensor linear(
    const at::Tensor& input, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& sums,
    const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "int8_rows_linear: x must be float32");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == kGroup, "int8_rows_linear: W not packed");
  const int64_t k = input.size(-1), groups = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(groups == (k + kGroup - 1) / kGroup, "int8_rows_linear: x has ", k, " features, W was packed for ",
              groups * kGroup);
  TORCH_CHECK(out_features <= blocks * kLanes && scales.numel() == out_features && sums.numel() == out_features,
              "int8_rows_linear: scales or sums do not match W");
  // x as it is where it is contiguous, the output in its final shape, and the quantized rows in a buffer the thread
  // keeps (up to kKeptBytes): at a few rows these allocations were a third of the call (6 x 256 x 256: 3.5 -> 2.9 us)
  const at::Tensor x = input.is_contiguous() ? input : input.contiguous();
  const int64_t m = k == 0 ? 0 : x.numel() / k, padded = groups * kGroup;
  at::DimVector shape(input.sizes());
  shape.back() = out_features;
  auto y = at::empty(shape, x.options());
  if (m == 0) return y;
  thread_local std::vector<uint8_t> kept(kKeptBytes);
  std::vector<uint8_t> own;  // a call of more rows than the kept buffer holds
  const int64_t bytes = m * padded + m * static_cast<int64_t>(sizeof(float));
  if (bytes > kKeptBytes) own.resize(bytes);
  uint8_t* const xq_data = bytes > kKeptBytes ? own.data() : kept.data();
  float* const row_scale = reinterpret_cast<float*>(xq_data + m * padded);  // (padded: a multiple of 4 bytes)
  const float* xs = x.data_ptr<float>();
  const int64_t whole = k / kLanes * kLanes;
  for (int64_t r = 0; r < m; ++r) {
    const float* row = xs + r * k;
    __m512 largest16 = _mm512_setzero_ps();
    for (int64_t i = 0; i < whole; i += kLanes) largest16 = _mm512_max_ps(largest16, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
    float largest = _mm512_reduce_max_ps(largest16);
    for (int64_t i = whole; i < k; ++i) largest = std::max(largest, std::fabs(row[i]));
    const float scale = largest > 0.f ? largest / 127.f : 1.f;
    const float inverse = 1.f / scale;
    row_scale[r] = scale;
    uint8_t* q = xq_data + r * padded;
    const __m512 inverse16 = _mm512_set1_ps(inverse);
    const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127), offset = _mm512_set1_epi32(128);
    for (int64_t i = 0; i < whole; i += kLanes) {
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + i), inverse16));
      v = _mm512_add_epi32(_mm512_min_epi32(high, _mm512_max_epi32(low, v)), offset);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(v));
    }
    for (int64_t i = whole; i < k; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(row[i] * inverse));
      q[i] = static_cast<uint8_t>(std::min(127, std::max(-127, v)) + 128);
    }
    std::fill(q + k, q + padded, static_cast<uint8_t>(128));  // K's padding: zeros once the shift is taken out
  }
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* ws = scales.data_ptr<float>();
  const int32_t* shift = sums.data_ptr<int32_t>();
  const float* b = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  // Blocks of 16 columns shared among the threads, each thread at least kMinWork multiply-adds: a parallel region costs
  // microseconds, as much as a 256 x 1,024 product of 6 rows (1.5 million), which one thread does alone.
  const int64_t per_block = std::max<int64_t>(1, m * groups * kGroup * kLanes);
  at::parallel_for(0, blocks, std::max<int64_t>(1, kMinWork / per_block), [&](int64_t first, int64_t last) {
    alignas(64) int32_t acc[kBlocks * kMaxRows * kLanes];
    for (int64_t block = first; block < last; block += kBlocks) {
      const int64_t taken = std::min(kBlocks, last - block);
      const int8_t* wb = w + block * groups * kLanes * kGroup;
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, m - r0);
        kBlockFns[taken][rows](xq_data + r0 * padded, groups, wb, groups * kLanes * kGroup, acc);
        for (int64_t of = 0; of < taken; ++of) {
          const int64_t col0 = (block + of) * kLanes, cols = std::min(kLanes, out_features - col0);
          const int32_t* sums = acc + of * kMaxRows * kLanes;
          for (int64_t r = 0; r < rows; ++r) {
            float* dst = out + (r0 + r) * out_features + col0;
            const float s = row_scale[r0 + r];
            if (cols == kLanes) {  // the same operations as below, 16 columns at a time (no fused multiply-add)
              const __m512i sums16 =
                  _mm512_sub_epi32(_mm512_load_si512(sums + r * kLanes), _mm512_loadu_si512(shift + col0));
              __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sums16),
                                       _mm512_mul_ps(_mm512_set1_ps(s), _mm512_loadu_ps(ws + col0)));
              if (b != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(b + col0));
              _mm512_storeu_ps(dst, v);
              continue;
            }
            for (int64_t c = 0; c < cols; ++c) {
              const float v = static_cast<float>(sums[r * kLanes + c] - shift[col0 + c]) * (s * ws[col0 + c]);
              dst[c] = b != nullptr ? v + b[col0 + c] : v;
            }
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vaswani_tx_int8, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("shift_sums(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor scales, Tensor sums, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(vaswani_tx_int8, CPU, m) {
  m.impl("pack", pack);
  m.impl("shift_sums", shift_sums);
  m.impl("linear", linear);
}
