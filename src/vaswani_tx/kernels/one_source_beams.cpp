// Beam search's bookkeeping, a step at a time, for the sources of a call (one: a sentence a call; a few hundred: a
// call in batches): fast_decoding.py's `beam_search` loop (and `one_source_search`, one source) without the Python.
//
// Why: at a sentence a call the decoder's step is a fraction of a millisecond, and the Python around it (the 2k
// best continuations, the kept hypotheses, the length penalty, the early-stop test, the next tokens) took about as
// long again: some 40 small tensor operations and a few hundred float32 roundings a step, each a Python call. In
// batches the same work was some 100 tensor operations a step, 8-11% of a pass. Here one call a step does all of
// it. The choices are the Python loop's, operation for operation: the same ATen operations pick the 2k
// continuations (`largest`), the same torch.topk over the same rows orders the candidates and the kept hypotheses
// (so exact ties go the same way: its CPU kernel takes each row alone), and every sum and quotient is rounded to
// float32 where the Python loop rounds it (which is where transformers' float32 tensors do).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

// The library is built for any x86-64 CPU; its AVX-512 paths (functions with target("avx512f")) are taken where the
// CPU has it.
#if defined(__x86_64__) && defined(__GNUC__)
#define VASWANI_TX_AVX512 1
const bool kAvx512 = __builtin_cpu_supports("avx512f");
#endif

struct Entry {
  float score;
  std::vector<int64_t> ids;
  bool finished = false;
};

float lowered(float score) { return static_cast<float>(static_cast<double>(score) - 1e9); }

#ifdef VASWANI_TX_AVX512
// `block_maxima` sixteen columns at a time where the CPU has AVX-512 (a call in batches reads a few hundred sources'
// 4 x 8,000 scores a step, where four at a time took 0.5 ms a step on two threads). A maximum is exact in any order.
__attribute__((target("avx512f"))) void block_maxima_avx512(const float* scores, int64_t m, int64_t blocks,
                                                            int64_t block, const float* shift, float* maxima) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* from = scores + (r * blocks + b) * block;
      __m512 most = _mm512_loadu_ps(from);
      __mmask16 unordered = _mm512_cmp_ps_mask(most, most, _CMP_UNORD_Q);
      for (int64_t j = 16; j < block; j += 16) {
        const __m512 v = _mm512_loadu_ps(from + j);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        most = _mm512_max_ps(most, v);
      }
      const float largest = unordered ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(most);
      maxima[r * blocks + b] = largest + shift[r];
    }
  }
}
#endif

// maxima[r * blocks + b] = max(scores[r, b * block : (b + 1) * block]) + shift[r] over the whole blocks of each of the m
// rows of width blocks * block (ATen's amax and add: a NaN in a block makes its maximum NaN).
void block_maxima(const float* scores, int64_t m, int64_t blocks, int64_t block, const float* shift, float* maxima) {
#ifdef VASWANI_TX_AVX512
  if (kAvx512 && block % 16 == 0) return block_maxima_avx512(scores, m, blocks, block, shift, maxima);
#endif
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* from = scores + (r * blocks + b) * block;
      float largest = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t j = 0;
#if defined(__SSE2__)
      if (block >= 4) {
        // (each vector's NaNs are noted as it is read: _mm_max_ps gives its second operand where either is NaN, so
        // a NaN of the running maximum does not survive the next vector)
        __m128 most = _mm_loadu_ps(from), unordered = _mm_cmpunord_ps(most, most);
        for (j = 4; j + 4 <= block; j += 4) {
          const __m128 v = _mm_loadu_ps(from + j);
          unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
          most = _mm_max_ps(most, v);
        }
        nan = _mm_movemask_ps(unordered) != 0;
        alignas(16) float four[4];
        _mm_store_ps(four, most);
        for (float v : four) largest = v > largest ? v : largest;
      }
#endif
      for (; j < block; ++j) {
        nan = nan || std::isnan(from[j]);
        largest = from[j] > largest ? from[j] : largest;
      }
      maxima[r * blocks + b] = (nan ? std::numeric_limits<float>::quiet_NaN() : largest) + shift[r];
    }
  }
}

// Up to this many of a row's largest are found by `distinct_top` (beam search's 2k of each source).
constexpr int64_t kDistinctTopMax = 64;

#ifdef VASWANI_TX_AVX512
// `distinct_top`'s scan from column j on, sixteen columns at a time: those above the (k+1)-th largest so far, or NaN,
// are taken one by one (in column order, as the plain scan takes them). False at a NaN.
template <class Insert>
__attribute__((target("avx512f"))) bool distinct_top_avx512(const float* row, int64_t n, int64_t k, int64_t j,
                                                           const float* best, Insert& insert) {
  for (; j < n; j += 16) {
    const __mmask16 in_row = j + 16 <= n ? static_cast<__mmask16>(0xFFFF)
                                         : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(in_row, row + j);
    unsigned above = _mm512_mask_cmp_ps_mask(in_row, v, _mm512_set1_ps(best[k]), _CMP_NLE_UQ);  // > or NaN
    for (; above != 0; above &= above - 1) {
      const int64_t column = j + __builtin_ctz(above);
      const float x = row[column];
      if (std::isnan(x)) return false;
      if (x > best[k]) insert(x, column);  // (the (k+1)-th may have risen within these sixteen)
    }
  }
  return true;
}
#endif

// The k largest of a row of n > k float32 scores in descending order, where its k + 1 largest are distinct and no
// score is NaN: then exactly one answer is right, and it is torch.topk's too. Returns false otherwise (exact ties, a
// NaN), where only torch.topk can say which of the tied indices it gives and in what order.
bool distinct_top(const float* row, int64_t n, int64_t k, float* values, int64_t* indices) {
  float best[kDistinctTopMax + 1];  // the k + 1 largest so far, in descending order
  int64_t at[kDistinctTopMax + 1];
  int64_t count = 0;
  auto insert = [&](float x, int64_t j) {
    int64_t i = std::min(count, k);
    for (; i > 0 && best[i - 1] < x; --i) best[i] = best[i - 1], at[i] = at[i - 1];
    best[i] = x, at[i] = j;
    count = std::min(count + 1, k + 1);
  };
  int64_t j = 0;
  for (; j < n && count <= k; ++j) {
    if (std::isnan(row[j])) return false;
    insert(row[j], j);
  }
#ifdef VASWANI_TX_AVX512
  if (kAvx512) {
    // sixteen at a time against the (k+1)-th so far: most scores are below it, a NaN is not (unordered)
    if (!distinct_top_avx512(row, n, k, j, best, insert)) return false;
    j = n;
  }
#endif
  for (; j < n; ++j) {
    const float x = row[j];
    if (std::isnan(x)) return false;
    if (x > best[k]) insert(x, j);  // (one equal to the (k+1)-th changes none of the first k)
  }
  for (int64_t i = 0; i < k; ++i) {
    if (!(best[i] > best[i + 1])) return false;
  }
  std::copy(best, best + k, values);
  std::copy(at, at + k, indices);
  return true;
}

// torch.topk(scores, k) of float32 (rows, n) scores: each row's k largest, (values, indices) (rows, k). Rows whose
// answer is the only one (`distinct_top`) are found in one pass here: torch's CPU top-k (std::nth_element over
// (value, index) pairs) took 0.29 ms over 200 rows of 500, two threads, a third of a batch's bookkeeping. The others are torch.topk's
// over those rows alone (its CPU kernel takes each row alone, so they come out as in the whole tensor's).
std::pair<at::Tensor, at::Tensor> top_rows(const at::Tensor& scores, int64_t k) {
  const int64_t rows = scores.size(0), n = scores.size(1);
  if (scores.scalar_type() != at::kFloat || !scores.is_contiguous() || k > kDistinctTopMax || n <= k) {
    auto [values, indices] = at::topk(scores, k);
    return {values.contiguous(), indices.contiguous()};
  }
  auto values = at::empty({rows, k}, scores.options());
  auto indices = at::empty({rows, k}, scores.options().dtype(at::kLong));
  const float* data = scores.data_ptr<float>();
  std::vector<int64_t> tied;
  for (int64_t r = 0; r < rows; ++r) {
    if (!distinct_top(data + r * n, n, k, values.data_ptr<float>() + r * k, indices.data_ptr<int64_t>() + r * k)) {
      tied.push_back(r);
    }
  }
  if (!tied.empty()) {
    const auto which = at::tensor(tied, at::kLong);
    auto [tied_values, tied_indices] = at::topk(scores.index_select(0, which), k);
    values.index_copy_(0, which, tied_values);
    indices.index_copy_(0, which, tied_indices);
  }
  return {values, indices};
}

struct Source {
  std::vector<Entry> running, kept;
  bool improvable = true;  // transformers' `is_early_stop_heuristic_unsatisfied`
};

// At least this many scores a share of `largest`'s block maxima when they are shared between torch's threads (a call
// in batches: a few hundred sources of 4 x 8,000 scores a step); fewer (a sentence a call) stay on one thread.
constexpr int64_t kMaximaPerThread = 1 << 18;

class Beams {
 public:
  // prompts: each row's decoder prefix (sources x num_beams rows, source-major, as transformers expands them);
  // penalties[n]: n ** length_penalty (n output tokens), rounded to float32 here; early_stopping: whether it is True
  // (not False or "never"); best_length: the length the early-stop test divides the best running score by, -1 for
  // the current one (transformers takes the longest with "never" and a positive penalty); max_length: the stopping
  // criteria's (-1: none); ends: the end-of-sentence ids; block, block_top_k_min: fast_decoding.py's BLOCK and
  // BLOCK_TOP_K_MIN.
  Beams(const at::Tensor& prompts, int64_t num_beams, int64_t k2, std::vector<double> penalties, bool early_stopping,
        int64_t best_length, int64_t max_length, std::vector<int64_t> ends, int64_t block, int64_t block_top_k_min)
      : num_beams_(num_beams), k2_(k2), early_stopping_(early_stopping), best_length_(best_length),
        max_length_(max_length), ends_(std::move(ends)), block_(block), block_top_k_min_(block_top_k_min) {
    TORCH_CHECK(num_beams >= 1 && k2 >= num_beams, "beams: need 1 <= num_beams <= k2");
    TORCH_CHECK(prompts.dim() == 2 && prompts.size(0) > 0 && prompts.size(0) % num_beams == 0,
                "beams: the prompts must be (sources x num_beams, length)");
    for (double p : penalties) penalties_.push_back(static_cast<float>(p));
    const auto ids = prompts.to(at::kLong).contiguous();
    prompt_len_ = cur_len_ = ids.size(1);
    const int64_t* data = ids.data_ptr<int64_t>();
    for (int64_t s = 0; s < ids.size(0) / num_beams; ++s) {
      Source source;
      for (int64_t beam = 0; beam < num_beams; ++beam) {
        const int64_t* row = data + (s * num_beams + beam) * prompt_len_;
        std::vector<int64_t> prompt(row, row + prompt_len_);
        source.running.push_back({beam == 0 ? 0.0f : -1e9f, prompt, false});
        source.kept.push_back({-1e9f, std::move(prompt), false});
      }
      sources_.push_back(std::move(source));
      active_.push_back(s);
    }
  }

  int64_t cur_len() const { return cur_len_; }
  int64_t num_beams() const { return num_beams_; }
  // The rows of the sources still decoded (the decoder's batch).
  int64_t rows() const { return static_cast<int64_t>(active_.size()) * num_beams_; }

  // The running beams' ids (rows, cur_len), for processors that read them.
  at::Tensor running_ids() const {
    auto out = at::empty({rows(), cur_len_}, at::kLong);
    int64_t* data = out.data_ptr<int64_t>();
    for (int64_t s : active_) {
      for (const auto& entry : sources_[s].running) data = std::copy(entry.ids.begin(), entry.ids.end(), data);
    }
    return out;
  }

  struct Step {
    bool done;
    std::optional<at::Tensor> still;  // the positions among the sources decoded of those that go on (None: all)
    std::optional<at::Tensor> rows;   // the row each new running beam continues (None: each its own)
    at::Tensor tokens;                // the next tokens (rows, 1)
  };

  // One step from the running beams' log-probabilities (rows, V) (the processors' output), transformers'
  // `_beam_search` step for each source still decoded: the 2k best continuations of its beams, the best k unfinished
  // go on, and those of the first k that ended replace the worst kept hypotheses while they score better (after the
  // length penalty). Then, as fast_decoding.py's `beam_search` after `_beam_search_has_unfinished_sequences`: done,
  // or the finished sources leave (`still`), and the rows the others' beams continue.
  Step advance(const at::Tensor& log_probs) {
    const int64_t A = static_cast<int64_t>(active_.size()), k = num_beams_, k2 = k2_;
    TORCH_CHECK(log_probs.dim() == 2 && log_probs.size(0) == A * k && log_probs.is_contiguous() &&
                    log_probs.device().is_cpu(),
                "beams: log-probabilities must be (rows, V), contiguous, on the CPU");
    const int64_t width = log_probs.size(1);
    auto shift = at::empty({A, k}, at::kFloat);
    for (int64_t a = 0; a < A; ++a) {
      for (int64_t beam = 0; beam < k; ++beam) shift.data_ptr<float>()[a * k + beam] = source(a).running[beam].score;
    }
    auto [values_, indices_] = largest(log_probs.view({A, k, width}), shift);
    const float* values = values_.data_ptr<float>();
    const int64_t* indices = indices_.data_ptr<int64_t>();
    const bool at_length = max_length_ >= 0 && cur_len_ + 1 >= max_length_;

    // Each candidate's beam, token, whether it ended, and its score as a running beam (an ended one's 1e9 lower)
    std::vector<int64_t> beams(A * k2), tokens(A * k2);
    std::vector<char> ended(A * k2);
    auto running_scores = at::empty({A, k2}, at::kFloat);
    float* running_score = running_scores.data_ptr<float>();
    bool all_ended = true;
    for (int64_t i = 0; i < A * k2; ++i) {
      beams[i] = indices[i] / width, tokens[i] = indices[i] % width;
      ended[i] = at_length || std::find(ends_.begin(), ends_.end(), tokens[i]) != ends_.end();
      running_score[i] = ended[i] ? lowered(values[i]) : values[i];
      all_ended = all_ended && ended[i];
    }
    // The k best continuations go on as running beams (transformers' `_get_running_beams_for_next_iteration`)
    const auto order_ = std::get<1>(at::topk(running_scores, k)).contiguous();
    const int64_t* order = order_.data_ptr<int64_t>();
    // Those among the first k that ended compete with the kept hypotheses, their scores divided by the length
    // penalty; the others (and all of them once the kept ones are full or nothing can improve) are 1e9 lower
    const float penalty = penalty_of(cur_len_ + 1 - prompt_len_);
    auto merged_scores = at::empty({A, k + k2}, at::kFloat);
    float* merged = merged_scores.data_ptr<float>();
    for (int64_t a = 0; a < A; ++a) {
      const Source& s = source(a);
      const bool full = all_finished(s.kept) && early_stopping_;
      float* row = merged + a * (k + k2);
      for (int64_t i = 0; i < k; ++i) row[i] = s.kept[i].score;
      for (int64_t j = 0; j < k2; ++j) {
        const bool finished = ended[a * k2 + j] && j < k;
        float score = values[a * k2 + j] / penalty;
        for (bool lower : {full, !s.improvable, !finished}) {
          if (lower) score = lowered(score);
        }
        row[k + j] = score;
      }
    }
    const auto picks_ = std::get<1>(at::topk(merged_scores, k)).contiguous();
    const int64_t* picks = picks_.data_ptr<int64_t>();

    cur_len_ += 1;
    const float best_penalty = penalty_of(best_length_ >= 0 ? best_length_ : cur_len_ - prompt_len_);
    bool any_improvable = false, all_kept = true;
    std::vector<char> finished(A);
    for (int64_t a = 0; a < A; ++a) {
      Source& s = source(a);
      auto continued = [&](int64_t j) {  // candidate j's ids: its beam's, then its token
        const auto& from = s.running[beams[a * k2 + j]].ids;
        std::vector<int64_t> ids;
        ids.reserve(from.size() + 1);
        ids.assign(from.begin(), from.end());
        ids.push_back(tokens[a * k2 + j]);
        return ids;
      };
      std::vector<Entry> kept, running;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t pick = picks[a * k + i];
        if (pick < k) {
          kept.push_back(std::move(s.kept[pick]));
        } else {
          const int64_t j = pick - k;
          kept.push_back({merged[a * (k + k2) + pick], continued(j), ended[a * k2 + j] && j < k});
        }
      }
      for (int64_t i = 0; i < k; ++i) running.push_back({running_score[a * k2 + order[a * k + i]],
                                                         continued(order[a * k + i]), false});
      s.kept = std::move(kept), s.running = std::move(running);
      // transformers' `_check_early_stop_heuristic`: can the best running beam still beat the worst kept one?
      const float best_possible = s.running[0].score / best_penalty;
      float worst = s.kept[0].score;
      for (const auto& entry : s.kept) worst = std::min(worst, entry.score);
      bool any = false;
      for (const auto& entry : s.kept) any = any || best_possible > (entry.finished ? worst : -1e9f);
      s.improvable = s.improvable && any;
      const bool source_kept = all_finished(s.kept);
      finished[a] = !s.improvable || (source_kept && early_stopping_);
      any_improvable = any_improvable || s.improvable;
      all_kept = all_kept && source_kept;
    }
    // transformers' `_beam_search_has_unfinished_sequences`, over the sources decoded this step
    std::vector<int64_t> still;
    for (int64_t a = 0; a < A; ++a) {
      if (!finished[a]) still.push_back(a);
    }
    if (!any_improvable || (all_kept && early_stopping_) || all_ended || still.empty()) {
      return {true, std::nullopt, std::nullopt, at::Tensor()};
    }
    const int64_t S = static_cast<int64_t>(still.size());
    auto rows_ = at::empty({S * k}, at::kLong);
    auto next = at::empty({S * k, 1}, at::kLong);
    int64_t* rows = rows_.data_ptr<int64_t>();
    bool in_order = S == A;
    std::vector<int64_t> active;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t a = still[i];
      for (int64_t beam = 0; beam < k; ++beam) {
        rows[i * k + beam] = a * k + beams[a * k2 + order[a * k + beam]];
        in_order = in_order && rows[i * k + beam] == i * k + beam;
        next.data_ptr<int64_t>()[i * k + beam] = source(a).running[beam].ids.back();
      }
      active.push_back(active_[a]);
    }
    active_ = std::move(active);
    std::optional<at::Tensor> kept_sources, reorder;
    if (S < A) kept_sources = at::tensor(still, at::kLong);
    if (!in_order) reorder = rows_;
    return {false, kept_sources, reorder, next};
  }

  // Each source's first `count` kept hypotheses (num_return_sequences), padded with `fill` to the longest
  // (sources x count, length).
  at::Tensor result(int64_t count, int64_t fill) const {
    TORCH_CHECK(count >= 1 && count <= num_beams_, "beams: need 1 <= count <= num_beams");
    size_t length = 0;
    for (const auto& s : sources_) {
      for (int64_t i = 0; i < count; ++i) length = std::max(length, s.kept[i].ids.size());
    }
    const int64_t S = static_cast<int64_t>(sources_.size());
    auto out = at::full({S * count, static_cast<int64_t>(length)}, fill, at::kLong);
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < count; ++i) {
        const auto& ids = sources_[s].kept[i].ids;
        std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>() + (s * count + i) * length);
      }
    }
    return out;
  }

 private:
  Source& source(int64_t a) { return sources_[active_[a]]; }

  static bool all_finished(const std::vector<Entry>& entries) {
    return std::all_of(entries.begin(), entries.end(), [](const Entry& e) { return e.finished; });
  }

  float penalty_of(int64_t n) const {
    TORCH_CHECK(n >= 0 && n < static_cast<int64_t>(penalties_.size()), "beams: no length penalty for ", n,
                " tokens");
    return penalties_[n];
  }

  // fast_decoding.py's `largest`: the k2 largest of each source's scores (A, m, V) + shift[:, :, None] (A, m), as
  // float32 values and indices into m x V (A, k2), by the same ATen operations (so exact ties go the same way).
  std::pair<at::Tensor, at::Tensor> largest(const at::Tensor& scores, const at::Tensor& shift) {
    const int64_t A = scores.size(0), m = scores.size(1), width = scores.size(2), blocks = width / block_;
    if (blocks * block_ != width || m * width < block_top_k_min_ || m * blocks < k2_ ||
        scores.scalar_type() != at::kFloat) {
      auto [values, indices] = largest_any(scores, shift);
      return {values.to(at::kFloat).contiguous(), indices.contiguous()};
    }
    // The same numbers by hand: ATen's amax over (A, m, blocks, 64), its gather and add (a maximum is exact, and each
    // sum is the same float32 addition), without their intermediate tensors
    const float* data = scores.data_ptr<float>();
    const float* shifts = shift.data_ptr<float>();
    auto maxima = at::empty({A, m * blocks}, scores.options());
    float* maxima_data = maxima.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, kMaximaPerThread / (m * width));
    at::parallel_for(0, A, grain, [&](int64_t begin, int64_t end) {
      for (int64_t a = begin; a < end; ++a) {
        block_maxima(data + a * m * width, m, blocks, block_, shifts + a * m, maxima_data + a * m * blocks);
      }
    });
    const auto chosen = top_rows(maxima, k2_).second;  // (A, k2) of the m x blocks
    const int64_t* chosen_blocks = chosen.data_ptr<int64_t>();
    auto values = at::empty({A, k2_ * block_}, scores.options());
    float* out = values.data_ptr<float>();
    for (int64_t a = 0; a < A; ++a) {
      for (int64_t i = 0; i < k2_; ++i) {
        const int64_t b = chosen_blocks[a * k2_ + i];
        const float* from = data + a * m * width + b * block_;
        const float add = shifts[a * m + b / blocks];
        float* to = out + (a * k2_ + i) * block_;
        for (int64_t j = 0; j < block_; ++j) to[j] = from[j] + add;
      }
    }
    auto [best, picked] = top_rows(values, k2_);
    auto indices = at::empty({A, k2_}, at::kLong);
    const int64_t* picks = picked.data_ptr<int64_t>();
    for (int64_t i = 0; i < A * k2_; ++i) {
      indices.data_ptr<int64_t>()[i] = chosen_blocks[(i / k2_) * k2_ + picks[i] / block_] * block_ + picks[i] % block_;
    }
    return {best, indices};
  }

  // fast_decoding.py's `largest` operation for operation (scores (A, m, V), shift (A, m)).
  std::pair<at::Tensor, at::Tensor> largest_any(const at::Tensor& scores, const at::Tensor& shift) {
    const int64_t A = scores.size(0), m = scores.size(1), width = scores.size(2), blocks = width / block_;
    if (m * width < block_top_k_min_ || m * blocks < k2_) {
      auto flat = scores + shift.unsqueeze(2);
      auto [values, indices] = at::topk(flat.reshape({A, m * width}), k2_);
      return {values, indices};
    }
    auto maxima = scores.slice(2, 0, blocks * block_).reshape({A, m, blocks, block_}).amax(-1);
    maxima += shift.unsqueeze(2);
    auto chosen = std::get<1>(at::topk(maxima.view({A, m * blocks}), k2_));
    auto beam = chosen.div(blocks, "floor");
    auto starts = beam * width + (chosen - beam * blocks) * block_;
    auto candidates = (starts.unsqueeze(2) + at::arange(block_, scores.options().dtype(at::kLong))).view({A, -1});
    auto flat = scores.view({A, m * width});
    auto values = flat.gather(1, candidates);
    values.view({A, k2_, block_}).add_(shift.gather(1, beam).unsqueeze(2));
    if (blocks * block_ < width) {
      auto longs = scores.options().dtype(at::kLong);
      auto columns = at::arange(blocks * block_, width, longs);
      auto tail = (columns + width * at::arange(m, longs).unsqueeze(1)).view({-1});
      auto tail_values = flat.index({at::indexing::Slice(), tail});
      tail_values += shift.repeat_interleave(width - blocks * block_, 1);
      candidates = at::cat({candidates, tail.expand({A, -1})}, 1);
      values = at::cat({values, tail_values}, 1);
    }
    auto [best, picked] = at::topk(values, k2_);
    return {best, candidates.gather(1, picked)};
  }

  int64_t num_beams_, k2_;
  bool early_stopping_;
  int64_t best_length_, max_length_;
  std::vector<int64_t> ends_;
  int64_t block_, block_top_k_min_, prompt_len_ = 0, cur_len_ = 0;
  std::vector<float> penalties_;
  std::vector<Source> sources_;
  std::vector<int64_t> active_;  // each source still decoded, in the decoder's order
};

// A copy of this many bytes in all (keys and values) goes past the caches: written with streaming stores, which skip
// reading each destination line before writing it (a third of the memory traffic). Multi30k val in batches of 4,096
// tokens reorders 1,800 rows x 16 positions x 3 layers, 84 MiB a tensor: 9.3 against 12.3 ms (one thread, AMD
// EPYC). Smaller copies keep memcpy's ordinary stores: the step after reads them back from the cache.
constexpr int64_t kStreamBytes = 16 << 20;
// At least this many bytes per thread, else one thread copies it all (a sentence a call: a few hundred KiB).
constexpr int64_t kBytesPerThread = 1 << 20;

// `bytes` (a multiple of 64) from `from` to `to` (16-byte aligned) with non-temporal stores.
void stream_copy(char* to, const char* from, int64_t bytes) {
#if defined(__SSE2__)
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + offset));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + offset + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + offset + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + offset + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + offset), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + offset + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + offset + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + offset + 48), d);
  }
#else
  std::memcpy(to, from, bytes);
#endif
}

// fast_decoding.py's `PositionSlots.select_rows` (the reason for each choice is there): keys and values (layers,
// capacity, rows, h, d) keep (and are reordered to) `rows`, their `length` written positions plus the next step's
// slot (a copy of the last written position, which the step overwrites), into the spare where it has room. The
// copies are memcpy's of (h, d) vectors here: index_select and the index arithmetic around it were a dozen ATen
// operations, 30-40 us a step for a few hundred kilobytes at a sentence a call. In batches the copy is tens of
// megabytes a step, bound by memory: it is shared between torch's threads by (layer, position) and streamed
// (`kStreamBytes`); in batches on two threads a single-threaded copy was 16% of decoding.
//
// With `lineage` (rows, >= length), the buffers' rows are a beam search's followed without copying
// (`PositionSlots.follow`): row r's vector at position p is in row lineage[r, p] (of the buffers' old rows, as many or
// more: rows that left stay until the copy). The copy then takes new row i's at p from row lineage[rows[i], p], and
// its result is in order again.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> select_slots(
    const at::Tensor& keys, const at::Tensor& values, const std::optional<at::Tensor>& spare_keys,
    const std::optional<at::Tensor>& spare_values, int64_t length, const at::Tensor& rows,
    const std::optional<at::Tensor>& lineage) {
  const int64_t layers = keys.size(0), capacity = keys.size(1), old_rows = keys.size(2);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.device().is_cpu() && keys.device().is_cpu() &&
                  values.device().is_cpu(),
              "select_slots: rows must be 1-D int64, and every tensor on the CPU");
  const auto order = rows.contiguous();
  const int64_t* picked = order.data_ptr<int64_t>();
  const int64_t count = order.numel();
  // the rows picked from: the buffers', or the lineage's (fewer where rows have left a followed beam search)
  const int64_t among = lineage.has_value() ? lineage->size(0) : old_rows;
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(picked[i] >= 0 && picked[i] < among, "select_slots: row ", picked[i], " of ", among);
  }
  TORCH_CHECK(length <= capacity, "select_slots: ", length, " positions written, the buffers hold ", capacity);
  // sources[i * positions + p]: the old row new row i takes at position p (`positions` 1 without a lineage: rows[i])
  const int64_t positions = lineage.has_value() ? std::max<int64_t>(length, 1) : 1;
  std::vector<int64_t> sources(count * positions);
  if (lineage.has_value()) {
    TORCH_CHECK(lineage->dim() == 2 && lineage->scalar_type() == at::kLong && lineage->size(0) <= old_rows &&
                    lineage->size(1) >= length && lineage->stride(1) == 1,
                "select_slots: the lineage must be int64 (rows, positions written or more), unit stride in positions");
    const int64_t* table = lineage->data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i)
      for (int64_t p = 0; p < positions; ++p) {
        const int64_t from = length ? table[picked[i] * lineage->stride(0) + p] : picked[i];
        TORCH_CHECK(from >= 0 && from < old_rows, "select_slots: lineage row ", from, " of ", old_rows);
        sources[i * positions + p] = from;
      }
  } else {
    std::copy_n(picked, count, sources.begin());
  }
  const int64_t slabs = layers * (length + 1);  // (layer, position) pairs, each `count` vectors
  int64_t total = 0;
  for (const auto* buffer : {&keys, &values}) {
    total += slabs * count * buffer->size(3) * buffer->size(4) * buffer->element_size();
  }
  std::vector<at::Tensor> out;
  for (const auto& [buffer, spare] : {std::pair{keys, spare_keys}, std::pair{values, spare_values}}) {
    TORCH_CHECK(buffer.dim() == 5 && buffer.is_contiguous(), "select_slots: buffers must be contiguous, 5-D");
    const std::vector<int64_t> shape{layers, length + 1, count, buffer.size(3), buffer.size(4)};
    const int64_t size = c10::multiply_integers(shape);
    at::Tensor target;  // `_within(spare, shape, buffer, slack=True)`
    if (!spare.has_value() || spare->numel() < size || spare->scalar_type() != buffer.scalar_type()) {
      target = at::empty({2 * size}, buffer.options()).slice(0, 0, size).view(shape);
    } else {
      target = spare->view({-1}).slice(0, 0, size).view(shape);
    }
    const int64_t vector = buffer.size(3) * buffer.size(4) * buffer.element_size();  // bytes of one (h, d)
    const auto* from = static_cast<const char*>(buffer.data_ptr());
    auto* to = static_cast<char*>(target.data_ptr());
    // Streaming stores need aligned destinations: every vector's is where the target's is and vectors are whole
    // 64-byte lines.
    const bool stream = total >= kStreamBytes && vector % 64 == 0 && reinterpret_cast<uintptr_t>(to) % 16 == 0;
    const int64_t slab_bytes = std::max<int64_t>(count * vector, 1);
    at::parallel_for(0, slabs, std::max<int64_t>(1, kBytesPerThread / slab_bytes), [&](int64_t begin, int64_t end) {
      for (int64_t slab = begin; slab < end; ++slab) {
        const int64_t layer = slab / (length + 1), position = slab % (length + 1);
        const int64_t source = std::min(position, std::max<int64_t>(length - 1, 0));
        const char* row0 = from + ((layer * capacity + source) * old_rows) * vector;
        char* dst = to + slab * count * vector;
        const int64_t column = std::min(source, positions - 1);
        for (int64_t i = 0; i < count; ++i) {
          const char* vector_from = row0 + sources[i * positions + column] * vector;
          if (stream) {
            stream_copy(dst + i * vector, vector_from, vector);
          } else {
            std::memcpy(dst + i * vector, vector_from, vector);
          }
        }
      }
#if defined(__SSE2__)
      if (stream) _mm_sfence();  // this thread's streamed lines visible before the copy returns
#endif
    });
    out.push_back(target);
  }
  auto whole = [](const at::Tensor& buffer) {  // the allocation the buffer is a view of (`buffer._base`)
    const int64_t elements = static_cast<int64_t>(buffer.storage().nbytes()) / buffer.element_size();
    return at::empty({0}, buffer.options()).set_(buffer.storage(), 0, {elements}, {1});
  };
  return {out[0], out[1], whole(keys), whole(values)};
}

// fast_decoding.py's `PositionSlots.views` once the buffers have room: each layer's (P + 1, G, k, h, d) view of its
// written positions and this step's slot, as two tuples (one call rather than a dozen Python tensor operations).
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> slot_views(const at::Tensor& keys, const at::Tensor& values,
                                                                    int64_t end, int64_t rows, int64_t groups,
                                                                    int64_t heads) {
  std::vector<at::Tensor> out_keys, out_values;
  for (const auto& [buffer, out] : {std::pair{&keys, &out_keys}, std::pair{&values, &out_values}}) {
    const int64_t depth = buffer->size(4);
    for (int64_t layer = 0; layer < buffer->size(0); ++layer) {
      out->push_back(buffer->select(0, layer).slice(0, 0, end).view({end, groups, rows / groups, heads, depth}));
    }
  }
  return {out_keys, out_values};
}

// Greedy search's int8 screen (fast_decoding.py's `ScreenedArgmax`, where the bound and why it holds are written),
// its work of a step in two calls around the processors' masking. In Python it was some 35 small tensor operations
// a step, 0.15-0.2 ms at one row where the int8 product itself takes 0.06 (two threads): as long as the decoder's
// step. First x^ (the rows in bfloat16) and the int8 product's logits, float32 (where the int8 few-rows kernel is not
// loaded: with it, `ScreenedArgmax` calls that kernel, whose rows are quantized to int8 within the kernel).
std::tuple<at::Tensor, at::Tensor> screened_logits(const at::Tensor& rows, const at::Tensor& quantized,
                                                   const at::Tensor& scales) {
  const auto rounded = rows.to(at::kBFloat16);
  return {rounded, at::_weight_int8pack_mm(rounded, quantized, scales).to(at::kFloat)};
}

// A screened logit's distance bound, base + per |v| (`bounds`), four at a time and one at a time: the same operations
// in the same order, so the same floats.
#if defined(__SSE2__)
inline __m128 margins(__m128 v, __m128 base4, __m128 per4) {
  const __m128 magnitude = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  return _mm_add_ps(base4, _mm_mul_ps(per4, _mm_and_ps(v, magnitude)));
}
#endif
inline float margin(float v, float base, float per) { return base + per * std::fabs(v); }

// The scans' last columns, one at a time (the vector loops below stop at a whole vector).
float lowest_end_from(const float* row, int64_t j, int64_t n, float base, float per, float lowest, bool& unusable) {
  const float infinity = std::numeric_limits<float>::infinity();
  for (; j < n; ++j) {
    const float v = row[j];
    unusable = unusable || std::isnan(v) || v == infinity;
    const float low = v - margin(v, base, per);
    lowest = low > lowest ? low : lowest;
  }
  return lowest;
}

int64_t mark_possible_from(const float* row, int64_t j, int64_t n, float base, float per, float lowest,
                           uint16_t* kept, std::vector<int64_t>& found) {
  int64_t count = 0;
  for (; j < n; ++j) {
    const float v = row[j];
    if (v + margin(v, base, per) >= lowest) {
      found.push_back(j);
      ++kept[j];
      ++count;
    }
  }
  return count;
}

// One row's screened logits `row` (n): the largest lower end v - (base + per |v|) over its columns (-inf for a masked
// column), and whether any logit is NaN or +inf. Four columns at a time where SSE2 is there: a scalar loop with its
// tests took 27 us at 8,000 columns.
float lowest_end_sse(const float* row, int64_t n, float base, float per, bool& unusable) {
  const float infinity = std::numeric_limits<float>::infinity();
  float lowest = -infinity;
  int64_t j = 0;
#if defined(__SSE2__)
  const __m128 base4 = _mm_set1_ps(base), per4 = _mm_set1_ps(per), inf4 = _mm_set1_ps(infinity);
  __m128 lowest4 = _mm_set1_ps(-infinity), bad = _mm_setzero_ps();
  for (; j + 4 <= n; j += 4) {
    const __m128 v = _mm_loadu_ps(row + j);
    bad = _mm_or_ps(bad, _mm_or_ps(_mm_cmpunord_ps(v, v), _mm_cmpeq_ps(v, inf4)));
    lowest4 = _mm_max_ps(lowest4, _mm_sub_ps(v, margins(v, base4, per4)));
  }
  alignas(16) float four[4];
  _mm_store_ps(four, lowest4);
  lowest = std::max(std::max(four[0], four[1]), std::max(four[2], four[3]));
  unusable = unusable || _mm_movemask_ps(bad) != 0;
#endif
  return lowest_end_from(row, j, n, base, per, lowest, unusable);
}

// Counts in `kept` the columns of one row whose upper end v + (base + per |v|) reaches `lowest` (-inf + inf is not
// a number: a masked column never does), and appends them to `found`; gives how many.
int64_t mark_possible_sse(const float* row, int64_t n, float base, float per, float lowest, uint16_t* kept,
                          std::vector<int64_t>& found) {
  int64_t count = 0, j = 0;
#if defined(__SSE2__)
  const __m128 base4 = _mm_set1_ps(base), per4 = _mm_set1_ps(per), lowest4 = _mm_set1_ps(lowest);
  for (; j + 4 <= n; j += 4) {
    const __m128 v = _mm_loadu_ps(row + j);
    int bits = _mm_movemask_ps(_mm_cmpge_ps(_mm_add_ps(v, margins(v, base4, per4)), lowest4));
    for (; bits != 0; bits &= bits - 1) {
      const int64_t column = j + __builtin_ctz(bits);
      found.push_back(column);
      ++kept[column];
      ++count;
    }
  }
#endif
  return count + mark_possible_from(row, j, n, base, per, lowest, kept, found);
}

// The same two scans sixteen columns at a time, where the CPU has AVX-512 (the library itself is built for any
// x86-64 CPU): 8,000 columns a row, some 50-300 rows a step in a batch of greedy search, where SSE's four at a time
// took 6.7 us a row (Intel Xeon). The same operations on each column as above (ISO C++ contracts no multiply-add), so
// the same floats; the maximum of the lower ends is the same float whatever the order.
#ifdef VASWANI_TX_AVX512
__attribute__((target("avx512f"))) float lowest_end_avx512(const float* row, int64_t n, float base, float per,
                                                          bool& unusable) {
  const float infinity = std::numeric_limits<float>::infinity();
  const __m512 base16 = _mm512_set1_ps(base), per16 = _mm512_set1_ps(per), inf16 = _mm512_set1_ps(infinity);
  __m512 lowest16 = _mm512_set1_ps(-infinity);
  __mmask16 bad = 0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(row + j);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, inf16, _CMP_EQ_OQ);
    const __m512 margin16 = _mm512_add_ps(base16, _mm512_mul_ps(per16, _mm512_abs_ps(v)));
    lowest16 = _mm512_max_ps(lowest16, _mm512_sub_ps(v, margin16));
  }
  float lowest = _mm512_reduce_max_ps(lowest16);
  unusable = unusable || bad != 0;
  return lowest_end_from(row, j, n, base, per, lowest, unusable);
}

__attribute__((target("avx512f"))) int64_t mark_possible_avx512(const float* row, int64_t n, float base, float per,
                                                                float lowest, uint16_t* kept,
                                                                std::vector<int64_t>& found) {
  const __m512 base16 = _mm512_set1_ps(base), per16 = _mm512_set1_ps(per), lowest16 = _mm512_set1_ps(lowest);
  int64_t count = 0, j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(row + j);
    const __m512 margin16 = _mm512_add_ps(base16, _mm512_mul_ps(per16, _mm512_abs_ps(v)));
    for (unsigned bits = _mm512_cmp_ps_mask(_mm512_add_ps(v, margin16), lowest16, _CMP_GE_OQ); bits != 0;
         bits &= bits - 1) {
      const int64_t column = j + __builtin_ctz(bits);
      found.push_back(column);
      ++kept[column];
      ++count;
    }
  }
  return count + mark_possible_from(row, j, n, base, per, lowest, kept, found);
}
#endif

float lowest_end(const float* row, int64_t n, float base, float per, bool& unusable) {
#ifdef VASWANI_TX_AVX512
  if (kAvx512) return lowest_end_avx512(row, n, base, per, unusable);
#endif
  return lowest_end_sse(row, n, base, per, unusable);
}

int64_t mark_possible(const float* row, int64_t n, float base, float per, float lowest, uint16_t* kept,
                      std::vector<int64_t>& found) {
#ifdef VASWANI_TX_AVX512
  if (kAvx512) return mark_possible_avx512(row, n, base, per, lowest, kept, found);
#endif
  return mark_possible_sse(row, n, base, per, lowest, kept, found);
}

// Then, over the screened logits (masked columns at -inf): each row's bound and the columns that can hold its
// maximum. A row with one column left needs no product: every other column's float32 logit is below that column's.
// The rows with several take the float32 logits of their columns by ATen's products, and each its argmax among them:
// one product of those rows and the union of their columns (ascending), where the union is at most `max_share` of
// the columns and the product at most that share of the whole one's multiply-adds, else a product of each row and its
// own columns (a row keeping more than that share: its whole row of logits, W not copied). (A batch of greedy search has
// 50-300 rows a step at first; on Multi30k val half keep one column and the union of the others' is some 100-450 of
// 8,000. Random rows of a small model keep a few columns each, but different ones: 220 of 300 rows kept 800 of
// 4,133 in all, a union product larger than the share.) An empty tensor where the caller computes every logit: a row
// with a NaN or +inf, or a row with no column left (all masked). The bound is computed in double and widened by a
// millionth, so that its own rounding never drops a column that the float32 bound keeps. `rounded` is x^, the rows
// the int8 product read, or none where the int8 few-rows kernel read them quantized to int8 (scale s = max |x| /
// 127 a row): then |x^ - x| <= sqrt(D) s (1/2 + 2e-5) (half a step each, the kernel's float32 x / s and s rounded),
// taken as sqrt(D) s (1 + 1e-4) / 2, and |x^| <= |x| + that.
at::Tensor screened_choice(const at::Tensor& rows, const std::optional<at::Tensor>& rounded,
                           const at::Tensor& screened, const at::Tensor& weight, double norm, double error,
                           double max_share) {
  const bool int8_rows = !rounded.has_value() || !rounded->defined();
  TORCH_CHECK(rows.dim() == 2 && screened.dim() == 2 && weight.dim() == 2 &&
                  (int8_rows || rows.sizes() == rounded->sizes()) && screened.size(0) == rows.size(0) &&
                  screened.size(1) == weight.size(0) && weight.size(1) == rows.size(1),
              "screened_choice: rows (R, D), rounded (R, D) or None, screened (R, V) and weight (V, D)");
  TORCH_CHECK(rows.scalar_type() == at::kFloat && screened.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat && rows.device().is_cpu() && screened.device().is_cpu() &&
                  weight.device().is_cpu(),
              "screened_choice: float32 tensors on the CPU");
  TORCH_CHECK(rows.size(0) < 65536, "screened_choice: at most 65,535 rows");  // (`kept` counts them in 16 bits)
  const auto x = rows.contiguous();
  const auto x_hat = int8_rows ? x : rounded->to(at::kFloat).contiguous();
  const auto logits_in = screened.contiguous();
  const int64_t count = x.size(0), width = x.size(1), vocabulary = logits_in.size(1);
  const float* xs = x.data_ptr<float>();
  const float* hs = x_hat.data_ptr<float>();
  const float* ss = logits_in.data_ptr<float>();
  constexpr double kFloat32Unit = 1.0 / (1 << 24), kBFloat16Unit = 1.0 / (1 << 8);
  constexpr double kWider = 1 + 1e-6;
  const auto none = [&] { return at::empty({0}, rows.options().dtype(at::kLong)); };
  std::vector<uint16_t> kept(vocabulary, 0);  // how many of the rows with several keep each column
  std::vector<int64_t> found;                 // each row's columns, one row after another
  std::vector<int64_t> several, starts;       // the rows that keep more than one, and where theirs start in `found`
  auto chosen = at::empty({count}, rows.options().dtype(at::kLong));
  int64_t* choice = chosen.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    double xx = 0, hh = 0, dd = 0, largest = 0;
    for (int64_t i = 0; i < width; ++i) {
      const double a = xs[r * width + i], b = hs[r * width + i];
      xx += a * a;
      hh += b * b;
      dd += (b - a) * (b - a);
      largest = std::max(largest, std::fabs(a));
    }
    const double x_norm = std::sqrt(xx);
    const double shift = int8_rows ? std::sqrt(static_cast<double>(width)) * largest / 127 * (1 + 1e-4) / 2
                                   : std::sqrt(dd);
    const double x_hat_norm = int8_rows ? x_norm + shift : std::sqrt(hh);
    // |x^ - x| |ŵ_j| + |x| |ŵ_j - w_j| + the sums' rounding; the bfloat16 result's part is per column (below)
    const double fixed = shift * norm + x_norm * error + 2 * width * kFloat32Unit * (x_norm + x_hat_norm) * norm;
    const float base = static_cast<float>(fixed * kWider), per = static_cast<float>(2 * kBFloat16Unit * kWider);
    const float* row = ss + r * vocabulary;
    bool unusable = false;
    const float lowest = lowest_end(row, vocabulary, base, per, unusable);
    if (unusable) return none();
    const auto start = static_cast<int64_t>(found.size());
    const int64_t possible = mark_possible(row, vocabulary, base, per, lowest, kept.data(), found);
    if (possible == 0) return none();
    if (possible == 1) {  // settled
      choice[r] = found[start];
      --kept[found[start]];
      found.resize(start);
    } else {
      several.push_back(r);
      starts.push_back(start);
    }
  }
  if (several.empty()) return chosen;
  starts.push_back(static_cast<int64_t>(found.size()));
  const float infinity = std::numeric_limits<float>::infinity();
  const auto long_options = rows.options().dtype(at::kLong);
  int64_t columns = 0;
  for (int64_t j = 0; j < vocabulary; ++j) columns += kept[j] != 0;
  const double share = max_share * static_cast<double>(vocabulary);
  const double union_work = static_cast<double>(several.size()) * static_cast<double>(columns);
  if (columns > share || union_work > share * static_cast<double>(count)) {
    for (size_t i = 0; i < several.size(); ++i) {  // each row and its own columns (ascending, as `found` holds them)
      const int64_t r = several[i], first = starts[i], own = starts[i + 1] - first;
      const auto picked = at::from_blob(found.data() + first, {own}, long_options);
      // (a row keeping many: its whole product, rather than a copy of most of W)
      auto logits = (own > share ? at::mv(weight, x[r]).index_select(0, picked)
                                 : at::mv(weight.index_select(0, picked), x[r])).contiguous();
      float* ls = logits.data_ptr<float>();
      for (int64_t c = 0; c < own; ++c) {  // the processors' masked columns stay masked
        if (ss[r * vocabulary + found[first + c]] == -infinity) ls[c] = -infinity;
      }
      choice[r] = found[first + logits.argmax().item<int64_t>()];
    }
    return chosen;
  }
  auto picked_columns = at::empty({columns}, long_options);
  int64_t* picked = picked_columns.data_ptr<int64_t>();
  for (int64_t j = 0, n = 0; j < vocabulary; ++j) {
    if (kept[j]) picked[n++] = j;
  }
  const auto multi = static_cast<int64_t>(several.size()) == count ? x : x.index_select(0, at::tensor(several, long_options));
  auto logits = at::mm(multi, weight.index_select(0, picked_columns).t()).contiguous();
  float* ls = logits.data_ptr<float>();
  for (size_t i = 0; i < several.size(); ++i) {  // the processors' masked columns stay masked
    const int64_t r = several[i];
    for (int64_t c = 0; c < columns; ++c) {
      if (ss[r * vocabulary + picked[c]] == -infinity) ls[i * columns + c] = -infinity;
    }
  }
  const auto best = logits.argmax(1);
  const int64_t* bs = best.data_ptr<int64_t>();
  for (size_t i = 0; i < several.size(); ++i) choice[several[i]] = picked[bs[i]];
  return chosen;
}

constexpr int64_t kLayerTensors = 22;  // see `decoder_rows`
constexpr int64_t kLayerProducts = 8;  // W^Q, W^K, W^V, W^O, the encoder-decoder W^Q and W^O, W_1, W_2

void check_rows_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(-1) == 1,
              "decoder_rows: ", what, " must be float32 on the CPU with unit stride in its last dimension");
}

// ---- the decoder's step for a few rows (a sentence a call) ----------------------------------------------------------
//
// Why: at a sentence a call (beam search's 4-6 rows of one source, greedy's one) the decoder's step is its products'
// reading of the weights from the cache hierarchy, 11 MB a step for the main job's model. Inductor's compiled few-rows
// step (compile_step.py) read them at 16-18 GB/s on an Intel Xeon, where one core reads 25-26; each of its 18
// products a step also sets up its blocking and a buffer. Here the whole step is one call: each product reads each
// 64-byte block of the model's own W (N, K) once for all the rows (up to 8) and sums 16 lanes a (row, column) pair;
// attention and the layer norms are loops over the step's few vectors. float32 throughout; the sums in another order
// than the compiled step's or the eager path's (the same results to float32 rounding).
#ifdef VASWANI_TX_AVX512
// How far ahead the products ask for W, in blocks of C columns: the hardware's prefetchers alone left a few rows'
// products waiting on the caches. Two blocks on (8 KB at 4 rows of the main job's model), the decoder's step took
// 0.36-0.39 against 0.52-0.63 ms at beam 4 and 0.19 against 0.25 ms greedy (a sentence a call, one thread, AMD EPYC
// Zen 5; on two threads 0.23-0.24 against 0.29-0.31 ms); one block on was between, three or four no better.
constexpr int64_t kPrefetchBlocks = 2;

// acc[r][c] += x[r, k:k+16] * W[c, k:k+16]; with `Masked`, the lanes beyond `mask` zero (K's last block).
template <int R, int C, bool Masked>
__attribute__((target("avx512f"))) inline void dot_step(__m512 (&acc)[R][C], const float* x, int64_t K, const float* w,
                                                        int64_t k, __mmask16 mask) {
  __m512 wv[C];
  // The same 64 bytes of the columns `kPrefetchBlocks` blocks on, asked for now (a prefetch never faults past W's end)
  for (int c = 0; c < C; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (c + kPrefetchBlocks * C) * K + k), _MM_HINT_T0);
  }
  for (int c = 0; c < C; ++c) wv[c] = Masked ? _mm512_maskz_loadu_ps(mask, w + c * K + k) : _mm512_loadu_ps(w + c * K + k);
  for (int r = 0; r < R; ++r) {
    const __m512 xv = Masked ? _mm512_maskz_loadu_ps(mask, x + r * K + k) : _mm512_loadu_ps(x + r * K + k);
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
  }
}

// y[r, n] = act(sum_k x[r, k] W[n, k] + b[n]) for R rows and C columns of W at once.
template <int R, int C>
__attribute__((target("avx512f"))) void dot_block(const float* x, int64_t K, const float* w, float* y, int64_t ldy,
                                                  const float* bias, bool relu) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) dot_step<R, C, false>(acc, x, K, w, k, 0xFFFF);
  if (k < K) dot_step<R, C, true>(acc, x, K, w, k, static_cast<__mmask16>((1u << (K - k)) - 1));
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float v = _mm512_reduce_add_ps(acc[r][c]);
      if (bias != nullptr) v += bias[c];
      y[r * ldy + c] = relu ? std::max(v, 0.0f) : v;
    }
}

// R rows (R * C accumulators in registers, C columns of W a block) over columns n0 .. n1 - 1 of N.
template <int R, int C>
void dot_rows(const float* x, int64_t K, const float* w, int64_t N, int64_t n0, int64_t n1, float* y,
              const float* bias, bool relu) {
  int64_t n = n0;
  for (; n + C <= n1; n += C) dot_block<R, C>(x, K, w + n * K, y + n, N, bias ? bias + n : nullptr, relu);
  for (; n < n1; ++n) dot_block<R, 1>(x, K, w + n * K, y + n, N, bias ? bias + n : nullptr, relu);
}

// Columns a thread takes at least: 64 KB of W, some 3 us of reading, against the few us of sharing the work (a
// product of the main job's model is 256 KB-1 MB). Each column is the same sum whichever thread computes it.
constexpr int64_t kThreadBytes = 1 << 16;

// y (M, N) = x (M, K) W^T + b for W (N, K) contiguous, ReLU'd with `relu`: up to 8 rows a pass over W, its columns
// shared between torch's threads.
void rows_linear(const float* x, int64_t M, const at::Tensor& weight, const at::Tensor& bias, float* y,
                 bool relu = false) {
  const float* w = weight.data_ptr<float>();
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;  // (empty: no bias)
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t grain = std::max<int64_t>(16, kThreadBytes / (K * static_cast<int64_t>(sizeof(float))));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M;) {
      const float* xs = x + m * K;
      float* ys = y + m * N;
      switch (std::min<int64_t>(M - m, 8)) {
        case 8: dot_rows<8, 2>(xs, K, w, N, n0, n1, ys, b, relu); m += 8; break;
        case 7: dot_rows<7, 2>(xs, K, w, N, n0, n1, ys, b, relu); m += 7; break;
        case 6: dot_rows<6, 2>(xs, K, w, N, n0, n1, ys, b, relu); m += 6; break;
        case 5: dot_rows<5, 3>(xs, K, w, N, n0, n1, ys, b, relu); m += 5; break;
        case 4: dot_rows<4, 4>(xs, K, w, N, n0, n1, ys, b, relu); m += 4; break;
        case 3: dot_rows<3, 4>(xs, K, w, N, n0, n1, ys, b, relu); m += 3; break;
        case 2: dot_rows<2, 8>(xs, K, w, N, n0, n1, ys, b, relu); m += 2; break;
        default: dot_rows<1, 8>(xs, K, w, N, n0, n1, ys, b, relu); m += 1; break;
      }
    }
  });
}

__attribute__((target("avx512f"))) float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const auto mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + i), _mm512_maskz_loadu_ps(mask, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f"))) void add_scaled(float a, const float* x, float* y, int64_t n) {
  const __m512 av = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// Where attention finds position p's key or value: `stride` floats a position; with `rows` (a beam's lineage), in row
// rows[p], `row_stride` floats a row.
struct Positions {
  int64_t stride;
  const int64_t* rows = nullptr;
  int64_t row_stride = 0;
  int64_t at(int64_t p) const { return p * stride + (rows != nullptr ? rows[p] * row_stride : 0); }
};

// Equation 1 for one query and head: out (d_v) = softmax(q . k_p / sqrt(d_k)) . v_p over `count` keys and values
// (found by `key_at` and `value_at`), those with valid[p] == 0 left out (an encoder-decoder mask; nullptr: none).
//
// Where d_k and d_v are whole vectors of 16 floats, up to 128 (`attend_in_registers`), q and the weighted sum stay in
// registers across the positions: in batches, the loads and stores of `dot` and `add_scaled` a position made the
// loops 6% of a pass (hundreds of rows, Multi30k val, beam 4, one thread). The sums are the same, in the same order.
// Attention asks for the keys (and values) of the position this many on: a row's self-attention keys lie a
// position's whole slice apart (the step's rows times the heads times d_k floats: hundreds of KB in batches), too far
// for the hardware's prefetchers to follow. Greedy search's int8 step over Multi30k val in batches: 0.33-0.35 against
// 0.36-0.40 s a pass (one thread, AMD EPYC Zen 5); 2 and 4 positions were as good, 8 worse. The same sums.
constexpr int64_t kAttendPrefetch = 4;
inline void prefetch_vectors(const float* at, int count) {  // `count` vectors of 16 floats from `at`
  for (int i = 0; i < count; ++i) _mm_prefetch(reinterpret_cast<const char*>(at + 16 * i), _MM_HINT_T0);
}

template <int K, int V>
__attribute__((target("avx512f"))) void attend_in_registers(const float* q, const float* keys, const float* values,
                                                            int64_t count, const Positions& key_at,
                                                            const Positions& value_at, float scaling,
                                                            const int64_t* valid, float* scores, float* out) {
  __m512 query[K], sum[V];
  for (int i = 0; i < K; ++i) query[i] = _mm512_loadu_ps(q + 16 * i);
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < count; ++p) {
    if (p + kAttendPrefetch < count) prefetch_vectors(keys + key_at.at(p + kAttendPrefetch), K);
    if (valid != nullptr && valid[p] == 0) {
      scores[p] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float* key = keys + key_at.at(p);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < K; ++i) acc = _mm512_fmadd_ps(query[i], _mm512_loadu_ps(key + 16 * i), acc);
    scores[p] = _mm512_reduce_add_ps(acc) * scaling;
    top = std::max(top, scores[p]);
  }
  float total = 0;
  for (int64_t p = 0; p < count; ++p) total += (scores[p] = std::exp(scores[p] - top));
  for (int i = 0; i < V; ++i) sum[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kAttendPrefetch && p < count; ++p) prefetch_vectors(values + value_at.at(p), V);
  for (int64_t p = 0; p < count; ++p) {
    if (p + kAttendPrefetch < count) prefetch_vectors(values + value_at.at(p + kAttendPrefetch), V);
    if (scores[p] == 0) continue;
    const __m512 weight = _mm512_set1_ps(scores[p] / total);
    const float* value = values + value_at.at(p);
    for (int i = 0; i < V; ++i) sum[i] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + 16 * i), sum[i]);
  }
  for (int i = 0; i < V; ++i) _mm512_storeu_ps(out + 16 * i, sum[i]);
}

void attend(const float* q, const float* keys, const float* values, int64_t count, const Positions& key_at,
            const Positions& value_at, int64_t d_k, int64_t d_v, float scaling, const int64_t* valid, float* scores,
            float* out) {
  if (d_k == d_v && d_k % 16 == 0 && d_k <= 128) {
    switch (d_k / 16) {
      case 1: return attend_in_registers<1, 1>(q, keys, values, count, key_at, value_at, scaling, valid, scores, out);
      case 2: return attend_in_registers<2, 2>(q, keys, values, count, key_at, value_at, scaling, valid, scores, out);
      case 4: return attend_in_registers<4, 4>(q, keys, values, count, key_at, value_at, scaling, valid, scores, out);
      case 8: return attend_in_registers<8, 8>(q, keys, values, count, key_at, value_at, scaling, valid, scores, out);
      default: break;
    }
  }
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < count; ++p) {
    scores[p] = (valid != nullptr && valid[p] == 0) ? -std::numeric_limits<float>::infinity()
                                                    : dot(q, keys + key_at.at(p), d_k) * scaling;
    top = std::max(top, scores[p]);
  }
  float total = 0;
  for (int64_t p = 0; p < count; ++p) total += (scores[p] = std::exp(scores[p] - top));
  std::fill(out, out + d_v, 0.0f);
  for (int64_t p = 0; p < count; ++p)
    if (scores[p] != 0) add_scaled(scores[p] / total, values + value_at.at(p), out, d_v);
}

// One row of `add_norm` of whole vectors of 16 floats: its sums 16 lanes at a time (in batches the scalar loops,
// each sum a chain of D additions, were 1.6% of a pass of Multi30k val).
__attribute__((target("avx512f"))) void add_norm_row(float* row, const float* add, int64_t D, const float* g,
                                                     const float* b, float eps) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(row + d), _mm512_loadu_ps(add + d));
    _mm512_storeu_ps(row + d, v);
    sum = _mm512_add_ps(sum, v);
  }
  const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(sum) / D);
  __m512 squares = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 centred = _mm512_sub_ps(_mm512_loadu_ps(row + d), mean);
    squares = _mm512_fmadd_ps(centred, centred, squares);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / D + eps));
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 normed = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + d), mean), inv);
    _mm512_storeu_ps(row + d, _mm512_fmadd_ps(normed, _mm512_loadu_ps(g + d), _mm512_loadu_ps(b + d)));
  }
}

// Rows a thread takes at least in the loops over the rows (attention, the norms): the few rows of a sentence a call stay
// on one (a parallel region costs a few microseconds, about a row's attention), a batch's hundreds are shared.
constexpr int64_t kAttendRows = 32;

// x = LayerNorm(x + sublayer) over each of M rows of D (Section 3.1's residual connection and normalization).
void add_norm(float* x, const float* sublayer, int64_t M, int64_t D, const at::Tensor& gamma, const at::Tensor& beta,
              float eps) {
  const float* g = gamma.data_ptr<float>();
  const float* b = beta.data_ptr<float>();
  at::parallel_for(0, M, kAttendRows, [&](int64_t begin, int64_t end) {  // (each row's sums in the same order)
    for (int64_t m = begin; m < end; ++m) {
      float* row = x + m * D;
      const float* add = sublayer + m * D;
      if (D % 16 == 0) {
        add_norm_row(row, add, D, g, b, eps);
        continue;
      }
      float sum = 0;
      for (int64_t d = 0; d < D; ++d) sum += (row[d] += add[d]);
      const float mean = sum / D;
      float squares = 0;
      for (int64_t d = 0; d < D; ++d) squares += (row[d] - mean) * (row[d] - mean);
      const float inv = 1.0f / std::sqrt(squares / D + eps);
      for (int64_t d = 0; d < D; ++d) row[d] = (row[d] - mean) * inv * g[d] + b[d];
    }
  });
}

// Sections 3.4 and 3.5: out (D) = token `id`'s row of the shared matrix times `scale` (sqrt(d_model)), plus its
// position's `encoding`; `caller` names the function in the error for an id outside the vocabulary.
void embed(int64_t id, const at::Tensor& embedding, float scale, const float* encoding, float* out,
           const char* caller) {
  const int64_t V = embedding.size(0), D = embedding.size(1);
  TORCH_CHECK(id >= 0 && id < V, caller, ": token id ", id, " is outside the vocabulary of ", V);
  const float* row = embedding.data_ptr<float>() + id * embedding.stride(0);
  for (int64_t d = 0; d < D; ++d) out[d] = row[d] * scale + encoding[d];
}

// Above this many rows a float32 product is torch's (`nn.Linear`'s: oneMKL's GEMM on Intel CPUs), which blocks x and
// W for the caches where `rows_linear` reads W again for each 8 rows. Decoding in batches (hundreds of rows a step)
// is then as fast as the compiled batched step (53 us a row each, the main job's model, 256-750 rows, one thread,
// Intel Xeon), and beam search's reordering is followed through lineages there too (`PositionSlots.follow`).
constexpr int64_t kRowsLinearMax = 16;

// oneDNN's inner product on W as it is (`mkldnn::_linear_pointwise`, what the compiled batched step calls where
// oneDNN is the chosen GEMM library): on other x86 CPUs than Intel's, torch's oneMKL product takes slow code paths,
// 2.0-2.5x oneDNN's time at 32-512 rows of the main job's shapes (AMD EPYC, one thread; benchmarks/bench_gemm.py).
// `relu`: max(0, .) as oneDNN writes the sums (a post-op), as the compiled step applies it.
at::Tensor onednn_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, bool relu) {
  static const auto linear = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
  return linear.call(input, weight, bias.numel() ? std::optional<at::Tensor>(bias) : std::nullopt,
                     relu ? "relu" : "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// The products of the decoder's step: y (M, N) = x (M, K) W^T + b, ReLU'd with `relu`, for the layer's tensor i (W)
// and i + 1 (b). FloatProducts: W float32 (N, K), `rows_linear` up to `kRowsLinearMax` rows, else torch's addmm, or
// oneDNN's inner product with `onednn` (`RowsModel`'s: the CPU's chosen GEMM library, `gemm_backend`).
struct FloatProducts {
  const at::Tensor* t;  // the layer's kLayerTensors
  bool onednn = false;
  int64_t out_features(int i) const { return t[i].size(0); }
  // Returns where the product is: y, or with `hold` where oneDNN's product comes as a tensor of its own, that tensor
  // (kept in `hold`), rather than a copy of it into y (in batches the copies were 1-1.5% of a pass of Multi30k val).
  const float* operator()(int i, const float* x, int64_t M, int64_t K, float* y, bool relu,
                          at::Tensor* hold = nullptr) const {
    if (M <= kRowsLinearMax) {
      rows_linear(x, M, t[i], t[i + 1], y, relu);
      return y;
    }
    const auto options = at::TensorOptions().dtype(at::kFloat);
    const at::Tensor input = at::from_blob(const_cast<float*>(x), {M, K}, options);
    if (onednn) {
      at::Tensor out = onednn_linear(input, t[i], t[i + 1], relu);
      if (hold != nullptr) {
        *hold = std::move(out);
        return hold->data_ptr<float>();
      }
      std::copy_n(out.data_ptr<float>(), M * t[i].size(0), y);
      return y;
    }
    at::Tensor output = at::from_blob(y, {M, t[i].size(0)}, options);
    if (t[i + 1].numel()) {
      at::addmm_out(output, t[i + 1], input, t[i].t());
    } else {
      at::mm_out(output, input, t[i].t());
    }
    if (relu) output.clamp_min_(0.0f);
    return y;
  }
};

// Int8Products: the int8 few-rows kernel's (int8_rows.cpp), each W its packing of the layer's int8 weights, beside
// their scales and shifted sums, through the operator that kernel's library registers (`vaswani_tx_int8::linear`;
// loaded into this process first). A call through the dispatcher costs about a microsecond, where the compiled int8
// step's AOTInductor proxy executor took some 10 for each of its 18 calls a step.
struct Int8Products {
  const at::Tensor* t;  // the layer's tensors
  const at::Tensor* q;  // the layer's products' weight scales and shifted sums, two a product in the same order
  // Tensor i's product among the layer's: each W is followed by its b, and a norm's two tensors sit at 8, 14 and 20
  // (a decoder layer's W^Q, W^K, W^V, W^O at 0-6, its encoder-decoder W^Q, W^O at 10, 12, W_1, W_2 at 16, 18; an
  // encoder layer's W_1, W_2 at 10, 12; a decoder layer's encoder-decoder W^K, W^V at 0, 2 of their own list).
  static int number(int i) { return (i - 2 * ((i > 8) + (i > 14) + (i > 20))) / 2; }
  int64_t out_features(int i) const { return q[2 * number(i)].numel(); }
  // As FloatProducts': y, or with `hold` the kernel's own output tensor (kept in `hold`).
  const float* operator()(int i, const float* x, int64_t M, int64_t K, float* y, bool relu,
                          at::Tensor* hold = nullptr) const {
    static const auto linear = c10::Dispatcher::singleton()
        .findSchemaOrThrow("vaswani_tx_int8::linear", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const std::optional<at::Tensor>&, int64_t)>();
    const at::Tensor &bias = t[i + 1], &scales = q[2 * number(i)];
    const int64_t N = scales.numel();
    const at::Tensor input = at::from_blob(const_cast<float*>(x), {M, K}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor out = linear.call(input, t[i], scales, q[2 * number(i) + 1],
                                 bias.numel() ? std::optional<at::Tensor>(bias) : std::nullopt, N);
    float* o = out.data_ptr<float>();
    if (hold != nullptr) {
      if (relu) {
        for (int64_t j = 0; j < M * N; ++j) o[j] = std::max(o[j], 0.0f);
      }
      *hold = std::move(out);
      return o;
    }
    if (relu) {
      for (int64_t j = 0; j < M * N; ++j) y[j] = std::max(o[j], 0.0f);
    } else {
      std::copy_n(o, M * N, y);
    }
    return y;
  }
};

// The products of the tensors from `weights`[w] (and their scales and sums from `quantized`[q], for int8's).
template <class Products>
Products products_at(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& quantized, int64_t w,
                     int64_t q, bool onednn = false) {
  if constexpr (std::is_same_v<Products, Int8Products>) {
    return Products{weights.data() + w, quantized.data() + q};
  } else {
    return Products{weights.data() + w, onednn};
  }
}
#endif

// Where one layer's self-attention keys (or values) of the step's rows are: position p, source g, row j (of k a
// source), head a at base + p * position + g * source + j * row + a * head; `written` positions before this step's;
// `heads` heads of `depth` floats.
struct Slots {
  float* base;
  int64_t position, source, row, head, written, heads, depth;
  int64_t rows;  // the rows a position holds: the step's, or more where rows have left a followed beam search
  float* at(int64_t p, int64_t g, int64_t j, int64_t a) const {
    return base + p * position + g * source + j * row + a * head;
  }
};

// The slots of per-layer views (P + 1, G, k, h, d) (`PositionSlots.views`), whose last position is this step's.
std::vector<Slots> view_slots(const std::vector<at::Tensor>& views, int64_t G, int64_t k) {
  std::vector<Slots> out;
  for (const at::Tensor& view : views) {
    check_rows_tensor(view, "the keys and values");
    TORCH_CHECK(view.dim() == 5 && view.size(1) == G && view.size(2) == k,
                "decoder_rows: keys of another shape than the rows' and sources'");
    TORCH_CHECK(view.size(0) == views[0].size(0), "decoder_rows: the layers' keys hold different numbers of positions");
    out.push_back({view.data_ptr<float>(), view.stride(0), view.stride(1), view.stride(2), view.stride(3),
                   view.size(0) - 1, view.size(3), view.size(4), G * k});
  }
  return out;
}

// The slots of all layers' buffer (layers, capacity, rows, h, d) (`PositionSlots.keys`), `written` positions written
// and room for this step's; the step's M rows are its first (more rows where rows have left a beam search followed
// through lineages: `PositionSlots.follow`).
std::vector<Slots> buffer_slots(const at::Tensor& buffer, int64_t written, int64_t M, int64_t k) {
  check_rows_tensor(buffer, "the keys and values");
  TORCH_CHECK(buffer.dim() == 5 && buffer.size(2) >= M && written >= 0 && buffer.size(1) > written,
              "decoder_rows: a buffer of keys or values without this step's slot for its ", M, " rows");
  std::vector<Slots> out;
  for (int64_t l = 0; l < buffer.size(0); ++l) {
    out.push_back({buffer.data_ptr<float>() + l * buffer.stride(0), buffer.stride(1), k * buffer.stride(2),
                   buffer.stride(2), buffer.stride(3), written, buffer.size(3), buffer.size(4), buffer.size(2)});
  }
  return out;
}

// The model's tensors that the few-rows step and the encoder read (`RowsDecoder`, `RowsEncoder` in
// compiled_decoding.py): the shared embedding matrix (V, D) times `scale`, every position's encoding (positions, D),
// the layers' tensors (`weights`) and, for int8's products, their weight scales and shifted sums (`quantized`).
// Made once a model: passing the ~100 tensors of a step from Python cost some 20 us a call (a step is 0.4 ms).
struct RowsModel {
  at::Tensor embedding, positions;
  double scale;
  std::vector<at::Tensor> weights, quantized;
  int64_t heads;
  double eps;
  // float32 products of more than `kRowsLinearMax` rows through oneDNN rather than torch's addmm (`FloatProducts`)
  bool onednn = false;
  // The steps' working rows (`decoder_step`), kept for the model's sessions: a decoding call in batches makes a new
  // session each time sources finish. One step at a time uses it: a step holds the GIL throughout.
  mutable at::Tensor work;
};

// The decoder's step for M = G * k rows (G sources, k rows each), `DecoderStep`'s function (compile_step.py): tokens
// (G, k), this position's input of each row, embedded by the model's matrix times its scale plus its encoding of
// position P (the number of positions written so far); per layer the model's 22 tensors: the self-attention's W^Q,
// W^K, W^V, W^O and their biases (empty: none), its norm's weight and bias, the encoder-decoder attention's W^Q, W^O,
// their biases and its norm's, W_1, b_1, W_2, b_2 and the last norm's; `self_keys`/`self_values` per layer, into
// whose position P this position's are written; cross keys/values per layer (G, h, S, d); the source mask (G, S), 0
// at padding; `lineage` (none, or (M, > P) int64): where each row's earlier keys and values are, its column P set to
// the row itself. Returns the decoder's output (M, D). `Products` computes each W's product (with the model's
// `quantized`, for int8's).
#ifdef VASWANI_TX_AVX512
template <class Products>
at::Tensor decoder_step(const at::Tensor& tokens, const RowsModel& model, const std::vector<Slots>& self_keys,
                        const std::vector<Slots>& self_values, const std::vector<at::Tensor>& cross_keys,
                        const std::vector<at::Tensor>& cross_values, const at::Tensor& source_mask,
                        const std::optional<at::Tensor>& lineage, int64_t d_k, int64_t d_v) {
  TORCH_CHECK(kAvx512, "decoder_rows: this CPU lacks AVX-512");
  const std::vector<at::Tensor>& weights = model.weights;
  const int64_t layers = static_cast<int64_t>(self_keys.size()), heads = model.heads;
  TORCH_CHECK(layers > 0 && source_mask.dim() == 2 && source_mask.size(0) > 0, "decoder_rows: no layers or no sources");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerTensors && self_values.size() == self_keys.size() &&
                  cross_keys.size() == self_keys.size() && cross_values.size() == self_keys.size(),
              "decoder_rows: ", kLayerTensors, " weights, keys and values for each layer");
  const at::Tensor &embedding = model.embedding, &positions = model.positions;
  auto ids = tokens.to(at::kLong).contiguous();
  const int64_t M = ids.numel(), D = embedding.size(1);
  const int64_t P = self_keys[0].written;  // this step's position
  TORCH_CHECK(P < positions.size(0) && positions.size(1) == D, "decoder_rows: no positional encoding for position ", P);
  // Sections 3.4 and 3.5: the token's row of the shared matrix times sqrt(d_model), plus its position's encoding
  auto x = at::empty({M, D}, embedding.options());
  float* h = x.data_ptr<float>();
  const float factor = static_cast<float>(model.scale);
  const float* encoding = positions.data_ptr<float>() + P * positions.stride(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) embed(id[r], embedding, factor, encoding, h + r * D, "decoder_rows");
  auto mask = source_mask.to(at::kLong).contiguous();
  const int64_t G = mask.size(0), S = mask.size(1), k = M / G;
  TORCH_CHECK(G * k == M, "decoder_rows: ", M, " rows are not ", G, " sources' rows");
  const float scaling = 1.0f / std::sqrt(static_cast<float>(d_k));
  auto products_of = [&](int64_t l) {
    return products_at<Products>(weights, model.quantized, l * kLayerTensors, l * 2 * kLayerProducts, model.onednn);
  };
  const int64_t F = products_of(0).out_features(16);
  // the step's working rows, kept from step to step by a session (in batches some 10 MB, whose fresh pages the kernel
  // zeroed at every step: 9% of a pass of Multi30k val, beam 4, one thread)
  const int64_t width_k = heads * d_k, width_v = heads * d_v, size = M * (2 * width_k + 2 * width_v + D + F);
  at::Tensor& work = model.work;
  if (!work.defined() || work.numel() < size) work = at::empty({size}, embedding.options());
  float* const q = work.data_ptr<float>();
  float* const new_keys = q + M * width_k;
  float* const attended = new_keys + M * width_k;
  float* const new_values = attended + M * width_v;
  float* const out = new_values + M * width_v;
  float* const inner = out + M * D;
  const int64_t* valid = mask.data_ptr<int64_t>();
  // A beam search followed without copying the keys and values (`PositionSlots.follow`): lineage (M, > P), row r's
  // earlier positions in rows lineage[r, p]; its position P is its own row's, written here.
  int64_t* rows_of = nullptr;
  int64_t lineage_stride = 0;
  if (lineage.has_value()) {
    TORCH_CHECK(lineage->dim() == 2 && lineage->scalar_type() == at::kLong && lineage->device().is_cpu() &&
                    lineage->size(0) == M && lineage->size(1) > P && lineage->stride(1) == 1,
                "decoder_rows: the lineage must be int64 (rows, more than the positions written), unit stride");
    const int64_t held = self_keys[0].rows;
    for (const auto* slots : {&self_keys, &self_values})
      for (const Slots& s : *slots)
        TORCH_CHECK(s.source == k * s.row && s.rows == held,
                    "decoder_rows: a lineage needs each position's rows contiguous, as many in every buffer");
    rows_of = lineage->data_ptr<int64_t>();
    lineage_stride = lineage->stride(0);
    // Each row reads only rows of its own source: checked where the buffers hold the step's rows; where rows have left
    // (sources finished, `held` > M) a row's source is no longer its buffer row's, and the rows are checked in range.
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t p = 0; p < P; ++p) {
        const int64_t row = rows_of[r * lineage_stride + p];
        TORCH_CHECK(row >= 0 && row < held && (held != M || row / k == r / k), "decoder_rows: lineage row ", row,
                    " for row ", r, " of ", k, " a source, ", held, " rows held");
      }
      rows_of[r * lineage_stride + P] = r;
    }
  }
  at::Tensor held[5];  // products' own output tensors, where they come as such (oneDNN's, the int8 kernel's)
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* t = weights.data() + l * kLayerTensors;
    const Products product = products_of(l);
    const Slots &keys = self_keys[l], &values = self_values[l];
    const at::Tensor &ck = cross_keys[l], &cv = cross_values[l];
    for (const at::Tensor* tensor : {&ck, &cv}) check_rows_tensor(*tensor, "the keys and values");
    TORCH_CHECK(keys.written == P && values.written == P, "decoder_rows: the layers' keys hold different numbers of "
                "positions");
    TORCH_CHECK(ck.dim() == 4 && ck.size(0) == G && ck.size(2) == S && cv.dim() == 4 && cv.size(0) == G &&
                    cv.size(2) == S, "decoder_rows: encoder-decoder keys of another shape than the sources'");
    TORCH_CHECK(keys.heads == heads && values.heads == heads && ck.size(1) == heads && cv.size(1) == heads &&
                    keys.depth == d_k && ck.size(3) == d_k && values.depth == d_v && cv.size(3) == d_v,
                "decoder_rows: keys and values of ", heads, " heads of ", d_k, " and ", d_v,
                " floats, as the encoder-decoder keys and values and the model");
    // Masked self-attention: this position's keys and values into slot P, then each row attends to positions 0..P
    // (each product where it is: the step's working rows, or oneDNN's own output tensor, held until used)
    const float* queries = product(0, h, M, D, q, false, &held[0]);
    const float* keys_in = product(2, h, M, D, new_keys, false, &held[1]);
    const float* values_in = product(4, h, M, D, new_values, false, &held[2]);
    at::parallel_for(0, M, kAttendRows, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(P + 1);
      for (int64_t r = begin; r < end; ++r)
        for (int64_t a = 0; a < heads; ++a) {
          const int64_t g = r / k, j = r % k;
          std::copy_n(keys_in + (r * heads + a) * d_k, d_k, keys.at(P, g, j, a));
          std::copy_n(values_in + (r * heads + a) * d_v, d_v, values.at(P, g, j, a));
          // its earlier positions: its own row's, or with a lineage each position's row (counted from the first
          // source's first row)
          const float* query = queries + (r * heads + a) * d_k;
          float* result = attended + (r * heads + a) * d_v;
          if (rows_of != nullptr) {
            const int64_t* rows = rows_of + r * lineage_stride;
            attend(query, keys.at(0, 0, 0, a), values.at(0, 0, 0, a), P + 1, {keys.position, rows, keys.row},
                   {values.position, rows, values.row}, d_k, d_v, scaling, nullptr, scores.data(), result);
          } else {
            attend(query, keys.at(0, g, j, a), values.at(0, g, j, a), P + 1, {keys.position}, {values.position},
                   d_k, d_v, scaling, nullptr, scores.data(), result);
          }
        }
    });
    add_norm(h, product(6, attended, M, heads * d_v, out, false, &held[3]), M, D, t[8], t[9],
             static_cast<float>(model.eps));
    // Encoder-decoder attention: each row to its own source's S positions
    const float* cross_queries = product(10, h, M, D, q, false, &held[0]);
    at::parallel_for(0, M, kAttendRows, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(S);
      for (int64_t r = begin; r < end; ++r)
        for (int64_t a = 0; a < heads; ++a) {
          const int64_t g = r / k;
          attend(cross_queries + (r * heads + a) * d_k, ck.data_ptr<float>() + g * ck.stride(0) + a * ck.stride(1),
                 cv.data_ptr<float>() + g * cv.stride(0) + a * cv.stride(1), S, {ck.stride(2)}, {cv.stride(2)}, d_k,
                 d_v, scaling, valid + g * S, scores.data(), attended + (r * heads + a) * d_v);
        }
    });
    add_norm(h, product(12, attended, M, heads * d_v, out, false, &held[3]), M, D, t[14], t[15],
             static_cast<float>(model.eps));
    // The position-wise feed-forward network (Equation 2)
    const float* hidden_units = product(16, h, M, D, inner, true, &held[4]);
    add_norm(h, product(18, hidden_units, M, F, out, false, &held[3]), M, D, t[20], t[21],
             static_cast<float>(model.eps));
  }
  return x;
}
#endif

// The model's tensors checked (`RowsModel`): int8 with `quantized` (each product's two).
RowsModel rows_model(const at::Tensor& embedding, double scale, const at::Tensor& positions,
                     std::vector<at::Tensor> weights, std::vector<at::Tensor> quantized, int64_t heads, double eps,
                     bool onednn = false) {
  check_rows_tensor(embedding, "the embedding matrix");
  check_rows_tensor(positions, "the positional encodings");
  TORCH_CHECK(quantized.empty() || quantized.size() * kLayerTensors == weights.size() * 2 * kLayerProducts,
              "decoder_rows_int8: each layer's products need their scales and sums");
  return {embedding, positions, scale, std::move(weights), std::move(quantized), heads, eps, onednn};
}

// One step through the model's float32 or int8 products.
at::Tensor model_step(const at::Tensor& tokens, const RowsModel& model, const std::vector<Slots>& self_keys,
                      const std::vector<Slots>& self_values, const std::vector<at::Tensor>& cross_keys,
                      const std::vector<at::Tensor>& cross_values, const at::Tensor& source_mask,
                      const std::optional<at::Tensor>& lineage) {
#ifdef VASWANI_TX_AVX512
  TORCH_CHECK(!cross_keys.empty(), "decoder_rows: no layers");
  const int64_t d_k = cross_keys[0].size(-1), d_v = cross_values[0].size(-1);
  if (!model.quantized.empty()) {
    return decoder_step<Int8Products>(tokens, model, self_keys, self_values, cross_keys, cross_values, source_mask,
                                      lineage, d_k, d_v);
  }
  return decoder_step<FloatProducts>(tokens, model, self_keys, self_values, cross_keys, cross_values, source_mask,
                                     lineage, d_k, d_v);
#else
  TORCH_CHECK(false, "decoder_rows: built for a CPU without AVX-512");
#endif
}

// A logits processor that sets columns to -inf (fast_decoding.py's `column_masks`), applied to the k beams'
// log-probabilities while from_len <= cur_len < until_len: minimum lengths (the end-of-sentence ids), suppressed tokens
// (always), or a length cap (`cap`: every column but columns[0], the end-of-sentence id, which becomes 0, or keeps its
// log-probability with `forced`), as `process` and `SourceLengthCap` apply them.
struct ColumnMask {
  std::vector<int64_t> columns;
  int64_t from_len, until_len;
  bool cap, forced;

  void apply(at::Tensor& scores, int64_t cur_len) const {
    if (cur_len < from_len || cur_len >= until_len) return;
    const int64_t rows = scores.size(0), width = scores.size(1);
    float* data = scores.data_ptr<float>();
    const float minus_inf = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      float* row = data + r * width;
      if (cap) {
        const float kept = forced ? row[columns[0]] : 0.0f;
        std::fill(row, row + width, minus_inf);
        row[columns[0]] = kept;
      } else {
        for (int64_t c : columns) row[c] = minus_inf;
      }
    }
  }
};

// A decoding call's step (`CompiledSession` in fast_decoding.py): the model's tensors and this call's sources'
// encoder-decoder keys and values and mask, passed once; each step then passes the tokens, the session's buffers of
// keys and values (`PositionSlots`) and their lineage.
class RowsSession {
 public:
  RowsSession(std::shared_ptr<RowsModel> model, std::vector<at::Tensor> cross_keys, std::vector<at::Tensor> cross_values,
              at::Tensor source_mask)
      : model_(std::move(model)), cross_keys_(std::move(cross_keys)), cross_values_(std::move(cross_values)),
        source_mask_(std::move(source_mask)) {}

  // tokens (G, k); keys and values (layers, capacity, G * k, h, d) with `written` positions written, this step's
  // slot beyond them.
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& keys, const at::Tensor& values, int64_t written,
                  const std::optional<at::Tensor>& lineage) const {
    const int64_t M = tokens.numel(), k = M / std::max<int64_t>(source_mask_.size(0), 1);
    return model_step(tokens, *model_, buffer_slots(keys, written, M, k), buffer_slots(values, written, M, k),
                      cross_keys_, cross_values_, source_mask_, lineage);
  }

  // One source's whole beam search (fast_decoding.py's `library_search`): the loop of `native_search` in one call, a
  // step being this session's step, the pre-softmax product of the float32 W (V, D) through the few-rows products
  // (`rows_projection`) plus the logits' fixed bias (Marian's; empty: none), ATen's log-softmax over them, the
  // processors' column masks (`masks`) and `beams.advance`. Why: at a sentence a call the Python around each step
  // (the session's buffers and lineage, the projection's buffer, the processors, the next tokens) took about 40 us
  // beside the library's 0.23 ms on two threads (the main job's model, beam 4, AMD EPYC Zen 5).
  // The same choices and sums as that loop: the first step decodes the start token once for all k beams
  // (`first_step`), whose rows then read its keys and values through their lineages (`PositionSlots.follow`), and
  // the buffers grow as `PositionSlots` grows them. Returns `beams.result(count, fill)`.
  at::Tensor search(Beams& beams, int64_t start, const at::Tensor& weight, const at::Tensor& bias,
                    const std::vector<ColumnMask>& masks, int64_t count, int64_t fill) const {
#ifdef VASWANI_TX_AVX512
    check_rows_tensor(weight, "the pre-softmax W");
    TORCH_CHECK(source_mask_.size(0) == 1 && !cross_keys_.empty() && weight.is_contiguous() &&
                    weight.size(1) == model_->embedding.size(1),
                "search: one source, and W (V, D) contiguous");
    TORCH_CHECK(bias.numel() == 0 || (bias.numel() == weight.size(0) && bias.is_contiguous() &&
                                      bias.scalar_type() == at::kFloat),
                "search: the logits' fixed bias must be float32 (V), contiguous, or empty");
    const int64_t k = beams.num_beams(), V = weight.size(0), D = weight.size(1);
    const int64_t layers = static_cast<int64_t>(cross_keys_.size()), heads = model_->heads;
    const int64_t d_k = cross_keys_[0].size(-1), d_v = cross_values_[0].size(-1);
    const auto floats = model_->embedding.options();
    at::Tensor keys, values, lineage;  // (layers, capacity, k, h, d); (k, capacity)
    auto make_room = [&](int64_t written) {  // `PositionSlots.make_room`: capacity max(16, 2 x positions)
      if (keys.defined() && keys.size(1) > written) return;
      const int64_t capacity = std::max<int64_t>(16, 2 * (written + 1));
      auto grown_keys = at::empty({layers, capacity, k, heads, d_k}, floats);
      auto grown_values = at::empty({layers, capacity, k, heads, d_v}, floats);
      auto grown_lineage = at::empty({k, capacity}, floats.dtype(at::kLong));
      if (written > 0) {
        grown_keys.narrow(1, 0, written).copy_(keys.narrow(1, 0, written));
        grown_values.narrow(1, 0, written).copy_(values.narrow(1, 0, written));
        grown_lineage.narrow(1, 0, written).copy_(lineage.narrow(1, 0, written));
      }
      keys = grown_keys, values = grown_values, lineage = grown_lineage;
    };
    auto logits = at::empty({k, V}, floats);
    auto tokens = at::full({1, 1}, start, floats.dtype(at::kLong));
    for (int64_t written = 0;; ++written) {
      make_room(written);
      at::Tensor hidden;
      if (written == 0) {  // one row for all k beams (`first_step`); the others' position 0 is row 0's
        hidden = model_step(tokens, *model_, buffer_slots(keys, 0, 1, 1), buffer_slots(values, 0, 1, 1), cross_keys_,
                            cross_values_, source_mask_, std::nullopt);
        lineage.select(1, 0).zero_();
      } else {
        hidden = model_step(tokens.view({1, k}), *model_, buffer_slots(keys, written, k, k),
                            buffer_slots(values, written, k, k), cross_keys_, cross_values_, source_mask_, lineage);
      }
      const int64_t M = hidden.size(0);
      auto scores = logits.narrow(0, 0, M);
      rows_linear(hidden.contiguous().data_ptr<float>(), M, weight, bias, scores.data_ptr<float>());
      at::_log_softmax_out(scores, scores, -1, false);
      if (M < k) logits.narrow(0, M, k - M).copy_(scores.expand({k - M, V}));
      const int64_t cur_len = beams.cur_len();
      for (const ColumnMask& mask : masks) mask.apply(logits, cur_len);
      Beams::Step next = beams.advance(logits);  // (one source: it goes on until done)
      if (next.done) return beams.result(count, fill);
      if (next.rows.has_value()) {  // (`PositionSlots.follow`: the rows continued, through their lineages)
        auto followed = lineage.narrow(1, 0, written + 1).index_select(0, *next.rows);
        lineage.narrow(1, 0, written + 1).copy_(followed);
      }
      tokens = next.tokens;
    }
#else
    TORCH_CHECK(false, "search: built for a CPU without AVX-512");
#endif
  }

 private:
  std::shared_ptr<RowsModel> model_;
  std::vector<at::Tensor> cross_keys_, cross_values_;
  at::Tensor source_mask_;
};

// The float32 step on per-layer views (P + 1, G, k, h, d) of the keys and values: the model's 22 tensors a layer, each
// W (N, K) float32 (`RowsDecoder` binds them once as a `RowsModel` for its sessions); `onednn` as `RowsModel`'s.
at::Tensor decoder_rows(const at::Tensor& tokens, const at::Tensor& embedding, double scale, const at::Tensor& positions,
                        const std::vector<at::Tensor>& weights,
                        const std::vector<at::Tensor>& self_keys, const std::vector<at::Tensor>& self_values,
                        const std::vector<at::Tensor>& cross_keys, const std::vector<at::Tensor>& cross_values,
                        const at::Tensor& source_mask, int64_t heads, double eps, bool onednn) {
  const RowsModel model = rows_model(embedding, scale, positions, weights, {}, heads, eps, onednn);
  const int64_t G = source_mask.size(0), k = tokens.numel() / std::max<int64_t>(G, 1);
  return model_step(tokens, model, view_slots(self_keys, G, k), view_slots(self_values, G, k), cross_keys,
                    cross_values, source_mask, std::nullopt);
}

// The int8 step (`--int8`): the same 22 tensors a layer, each W the int8 few-rows kernel's packing of the layer's
// int8 weights (int8_rows.py's `attach_weights`), and `quantized`, per layer each product's weight scales and
// shifted sums (W^Q, W^K, W^V, W^O, the encoder-decoder W^Q, W^O, W_1, W_2). Each product is the kernel's, as in the
// compiled int8 few-rows step, whose function this is.
at::Tensor decoder_rows_int8(const at::Tensor& tokens, const at::Tensor& embedding, double scale,
                             const at::Tensor& positions, const std::vector<at::Tensor>& weights,
                             const std::vector<at::Tensor>& quantized, const std::vector<at::Tensor>& self_keys,
                             const std::vector<at::Tensor>& self_values, const std::vector<at::Tensor>& cross_keys,
                             const std::vector<at::Tensor>& cross_values, const at::Tensor& source_mask, int64_t heads,
                             double eps) {
  TORCH_CHECK(!quantized.empty(), "decoder_rows_int8: each layer's products need their scales and sums");
  const RowsModel model = rows_model(embedding, scale, positions, weights, quantized, heads, eps);
  const int64_t G = source_mask.size(0), k = tokens.numel() / std::max<int64_t>(G, 1);
  return model_step(tokens, model, view_slots(self_keys, G, k), view_slots(self_values, G, k), cross_keys,
                    cross_values, source_mask, std::nullopt);
}

// ---- the encoder for one source (a sentence a call) -----------------------------------------------------------------
//
// The encoder stack over one source without padding (Section 3.1) and each decoder layer's encoder-decoder keys and
// values of its output (Section 3.2.3), `EncoderPass`'s function (compile_step.py), in one call: at a sentence a
// call the eager encoder is some 40 modules' calls, a millisecond for the main job's model's 13-token sources, most
// of it around products of a few microseconds. ids (1, S) embedded by `embedding` (V, D) times `scale` plus
// `positions` 0 .. S - 1; per encoder layer 16 tensors: W^Q, b, W^K, b, W^V, b, W^O, b (empty b: none), the norm's
// weight and bias, W_1, b_1, W_2, b_2 and the last norm's; `memory`, per decoder layer its encoder-decoder W^K, b,
// W^V, b. Returns the output (1, S, D), then each decoder layer's keys (1, h, S, d_k) and values (1, h, S, d_v).
constexpr int64_t kEncoderTensors = 16, kEncoderProducts = 6, kMemoryTensors = 4, kMemoryProducts = 2;

#ifdef VASWANI_TX_AVX512
template <class Products>
std::vector<at::Tensor> encoder_pass(const at::Tensor& ids, const at::Tensor& embedding, double scale,
                                     const at::Tensor& positions, const std::vector<at::Tensor>& weights,
                                     const std::vector<at::Tensor>& quantized, const std::vector<at::Tensor>& memory,
                                     const std::vector<at::Tensor>& memory_quantized, int64_t heads, int64_t d_k,
                                     int64_t d_v, double eps) {
  TORCH_CHECK(kAvx512, "encoder_rows: this CPU lacks AVX-512");
  const int64_t layers = static_cast<int64_t>(weights.size()) / kEncoderTensors;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kEncoderTensors &&
                  memory.size() % kMemoryTensors == 0 && ids.dim() == 2 && ids.size(0) == 1,
              "encoder_rows: ", kEncoderTensors, " tensors an encoder layer, ", kMemoryTensors,
              " a decoder layer, and one source");
  check_rows_tensor(embedding, "the embedding matrix");
  check_rows_tensor(positions, "the positional encodings");
  auto tokens = ids.to(at::kLong).contiguous();
  const int64_t S = tokens.size(1), D = embedding.size(1);
  TORCH_CHECK(S > 0 && S <= positions.size(0) && positions.size(1) == D, "encoder_rows: no positional encoding for ",
              S, " positions");
  auto x = at::empty({1, S, D}, embedding.options());
  float* h = x.data_ptr<float>();
  const float factor = static_cast<float>(scale);
  for (int64_t r = 0; r < S; ++r) {  // each source position's token at that position
    embed(tokens.data_ptr<int64_t>()[r], embedding, factor, positions.data_ptr<float>() + r * positions.stride(0),
          h + r * D, "encoder_rows");
  }
  const float scaling = 1.0f / std::sqrt(static_cast<float>(d_k));
  const int64_t width_k = heads * d_k, width_v = heads * d_v;
  std::vector<float> q(S * width_k), keys(S * width_k), values(S * width_v), attended(S * width_v), out(S * D),
      scores(S), inner;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* t = weights.data() + l * kEncoderTensors;
    const Products product = products_at<Products>(weights, quantized, l * kEncoderTensors, l * 2 * kEncoderProducts);
    const int64_t width_ff = product.out_features(10);
    inner.resize(S * width_ff);
    // Self-attention: each position to every position of the source (no mask: no padding)
    product(0, h, S, D, q.data(), false);
    product(2, h, S, D, keys.data(), false);
    product(4, h, S, D, values.data(), false);
    for (int64_t r = 0; r < S; ++r)
      for (int64_t a = 0; a < heads; ++a)
        attend(q.data() + r * width_k + a * d_k, keys.data() + a * d_k, values.data() + a * d_v, S, {width_k}, {width_v},
               d_k, d_v, scaling, nullptr, scores.data(), attended.data() + r * width_v + a * d_v);
    product(6, attended.data(), S, width_v, out.data(), false);
    add_norm(h, out.data(), S, D, t[8], t[9], static_cast<float>(eps));
    // The position-wise feed-forward network (Equation 2)
    product(10, h, S, D, inner.data(), true);
    product(12, inner.data(), S, width_ff, out.data(), false);
    add_norm(h, out.data(), S, D, t[14], t[15], static_cast<float>(eps));
  }
  std::vector<at::Tensor> result{x};
  for (int64_t j = 0; j < static_cast<int64_t>(memory.size()) / kMemoryTensors; ++j) {
    const Products product = products_at<Products>(memory, memory_quantized, j * kMemoryTensors, j * 2 * kMemoryProducts);
    for (int part = 0; part < 2; ++part) {  // the keys (W^K), then the values (W^V), as (1, h, S, d) for the session
      const int64_t d = part == 0 ? d_k : d_v;
      product(2 * part, h, S, D, part == 0 ? keys.data() : values.data(), false);
      const float* rows = part == 0 ? keys.data() : values.data();
      auto split = at::empty({1, heads, S, d}, embedding.options());
      float* to = split.data_ptr<float>();
      for (int64_t a = 0; a < heads; ++a)
        for (int64_t r = 0; r < S; ++r) std::copy_n(rows + r * heads * d + a * d, d, to + (a * S + r) * d);
      result.push_back(split);
    }
  }
  return result;
}
#endif

// The float32 encoder. A source of more than `kRowsLinearMax` tokens takes torch's products (oneMKL's), not oneDNN's
// as the batched step's may: oneDNN keeps a primitive for each number of rows, and a sentence a call's lengths made
// the process' peak 27 MB higher (Multi30k val, AMD EPYC) for no measured gain.
std::vector<at::Tensor> encoder_rows(const at::Tensor& ids, const at::Tensor& embedding, double scale,
                                     const at::Tensor& positions, const std::vector<at::Tensor>& weights,
                                     const std::vector<at::Tensor>& memory, int64_t heads, int64_t d_k, int64_t d_v,
                                     double eps) {
#ifdef VASWANI_TX_AVX512
  return encoder_pass<FloatProducts>(ids, embedding, scale, positions, weights, {}, memory, {}, heads, d_k, d_v, eps);
#else
  TORCH_CHECK(false, "encoder_rows: built for a CPU without AVX-512");
#endif
}

// The int8 encoder (`--int8`): the same tensors, each W the int8 few-rows kernel's packing, with `quantized` and
// `memory_quantized` each product's weight scales and shifted sums, as `decoder_rows_int8` takes them.
std::vector<at::Tensor> encoder_rows_int8(const at::Tensor& ids, const at::Tensor& embedding, double scale,
                                          const at::Tensor& positions, const std::vector<at::Tensor>& weights,
                                          const std::vector<at::Tensor>& quantized,
                                          const std::vector<at::Tensor>& memory,
                                          const std::vector<at::Tensor>& memory_quantized, int64_t heads, int64_t d_k,
                                          int64_t d_v, double eps) {
#ifdef VASWANI_TX_AVX512
  TORCH_CHECK(quantized.size() * kEncoderTensors == weights.size() * 2 * kEncoderProducts &&
                  memory_quantized.size() == memory.size(),
              "encoder_rows_int8: each layer's products need their scales and sums");
  return encoder_pass<Int8Products>(ids, embedding, scale, positions, weights, quantized, memory,
                                    memory_quantized, heads, d_k, d_v, eps);
#else
  TORCH_CHECK(false, "encoder_rows_int8: built for a CPU without AVX-512");
#endif
}

// The pre-softmax projection of a few rows (Section 3.4): out (M, V) = x (M, D) W^T, W (V, D) the model's own
// float32 matrix, through the few-rows products (each block of W read once for all M rows, `kPrefetchBlocks` ahead).
// Why: where W fits in the last-level cache, as the main job's model's 8 MB does, this reads it faster than oneDNN's
// inner product on W packed for it: 4 rows x 256 x 8,000 took 0.21-0.23 against 0.26-0.29 ms on one thread, 0.10
// against 0.14-0.15 on two (AMD EPYC Zen 5). A W read from memory (the base shape's 75 MB) streams faster through
// oneDNN's packed layout (2.7-2.9 against 2.3-2.5 ms at 4 rows), so `Projection` keeps oneDNN's there.
void rows_projection(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
#ifdef VASWANI_TX_AVX512
  check_rows_tensor(weight, "rows_projection's W");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == weight.size(1) &&
                  weight.is_contiguous(),
              "rows_projection: x must be contiguous float32 (M, D) for W (V, D)");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.size(1) == weight.size(0),
              "rows_projection: out must be contiguous float32 (M, V)");
  rows_linear(x.data_ptr<float>(), x.size(0), weight, at::empty({0}, x.options()), out.data_ptr<float>());
#else
  TORCH_CHECK(false, "rows_projection: built for a CPU without AVX-512");
#endif
}

bool decoder_rows_supported() {
#ifdef VASWANI_TX_AVX512
  return kAvx512;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Beams>(m, "Beams")
      .def(pybind11::init<const at::Tensor&, int64_t, int64_t, std::vector<double>, bool, int64_t, int64_t,
                          std::vector<int64_t>, int64_t, int64_t>())
      .def("advance",
           [](Beams& beams, const at::Tensor& log_probs) {
             Beams::Step step = beams.advance(log_probs);
             return std::make_tuple(step.done, step.still, step.rows, step.tokens);
           })
      .def("running_ids", &Beams::running_ids)
      .def("result", &Beams::result)
      .def_property_readonly("cur_len", &Beams::cur_len)
      .def_property_readonly("rows", &Beams::rows);
  pybind11::class_<RowsModel, std::shared_ptr<RowsModel>>(m, "RowsModel")
      .def(pybind11::init([](const at::Tensor& embedding, double scale, const at::Tensor& positions,
                             std::vector<at::Tensor> weights, std::vector<at::Tensor> quantized, int64_t heads,
                             double eps, bool onednn) {
             return std::make_shared<RowsModel>(
                 rows_model(embedding, scale, positions, std::move(weights), std::move(quantized), heads, eps, onednn));
           }),
           pybind11::arg("embedding"), pybind11::arg("scale"), pybind11::arg("positions"), pybind11::arg("weights"),
           pybind11::arg("quantized"), pybind11::arg("heads"), pybind11::arg("eps"), pybind11::arg("onednn") = false)
      .def("session", [](const std::shared_ptr<RowsModel>& model, std::vector<at::Tensor> cross_keys,
                         std::vector<at::Tensor> cross_values, at::Tensor source_mask) {
        return RowsSession(model, std::move(cross_keys), std::move(cross_values), std::move(source_mask));
      });
  pybind11::class_<ColumnMask>(m, "ColumnMask")
      .def(pybind11::init<std::vector<int64_t>, int64_t, int64_t, bool, bool>(), pybind11::arg("columns"),
           pybind11::arg("from_len"), pybind11::arg("until_len"), pybind11::arg("cap"), pybind11::arg("forced"));
  pybind11::class_<RowsSession>(m, "RowsSession")
      .def("step", &RowsSession::step)
      .def("search", &RowsSession::search);
  m.def("top_rows", &top_rows);
  m.def("select_slots", &select_slots);
  m.def("slot_views", &slot_views);
  m.def("screened_logits", &screened_logits);
  m.def("screened_choice", &screened_choice);
  m.def("decoder_rows", &decoder_rows);
  m.def("decoder_rows_int8", &decoder_rows_int8);
  m.def("encoder_rows", &encoder_rows);
  m.def("encoder_rows_int8", &encoder_rows_int8);
  m.def("rows_projection", &rows_projection);
  m.def("decoder_rows_supported", &decoder_rows_supported);
}
