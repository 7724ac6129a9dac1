// The C kernels' torch ops, dispatched from C++ (kernels/cpp_ops.py builds and loads this file).
//
// Each op (gptoss_lite::rows_mm, moe_experts, block_attention, bf16_gemv, mxfp4_matvec,
// mxfp4_matvec_int8 and mxfp4_gate_up_act) is defined in Python with
// torch.library.custom_op, whose implementation checks the arguments, makes them contiguous and calls
// the C kernel through ctypes. From a compiled step that path goes dispatcher -> Python -> ctypes and
// back: ~20 us a call beyond the kernel, where a step of the engine calls ~33 of them. This file gives
// each op a CPU implementation in C++ that does the same checks and conversions and calls the same C
// function (its address handed over by gl_ops_bind once the kernel's library has loaded), so the call
// never enters Python. The checks raise ValueError with the Python wrapper's words (TORCH_CHECK_VALUE).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using rows_fn_t = void (*)(const float *, const float *, const float *, int64_t, int64_t, int64_t, float *);
using moe_fn_t = int (*)(const void *, int, const int64_t *, const float *, int64_t, int64_t, const void *, const void *,
                         const void *, const void *, int64_t, int64_t, int64_t, int, float, float *);
using blocks_fn_t = int (*)(const float *, int64_t, int64_t, int64_t, int64_t, const void *, const void *, int, int64_t,
                            int64_t, const int64_t *, int64_t, const int64_t *, int64_t, int64_t, int64_t,
                            const float *, int64_t, float, int, float *);

using gemv_fn_t = void (*)(const void *, const void *, const float *, int64_t, int64_t, int64_t, float *);
using mxfp4_fn_t = void (*)(const void *, int, const void *, const void *, const int64_t *, const float *, int64_t,
                            int64_t, int64_t, int64_t, float *);
using gate_up_act_fn_t = int (*)(const void *, int, int, const void *, const void *, const int64_t *, const void *, int,
                                 int64_t, int64_t, int64_t, int64_t, int, float, int, void *);

rows_fn_t rows_fn = nullptr;
gemv_fn_t gemv_fn = nullptr;
mxfp4_fn_t mxfp4_fn = nullptr, mxfp4_int8_fn = nullptr;
gate_up_act_fn_t gate_up_act_fn = nullptr;
bool mxfp4_bf16_dot = false;  // gl_has_bf16_dot(): the exact kernel takes bf16 inputs as they are
moe_fn_t moe_fn = nullptr;
int moe_isa = 0;  // gl_moe_isa(): 1 serves fp32, 2 fp32 and bf16
blocks_fn_t blocks_fn = nullptr;

std::string shape(const at::Tensor &t) {
    std::ostringstream s;
    s << t.sizes();
    return s.str();
}

const void *ptr_or_null(const std::optional<at::Tensor> &t) { return t ? t->const_data_ptr() : nullptr; }

// x (M, K) times an out-major weight w (R, K), plus b, as fp32 sums: rows_mm (fp32) and bf16_gemv (bf16)
// check and convert alike and differ in their storage's dtype and the C function they call.
template <typename Call>
at::Tensor rows_times_weight(const char *op, at::ScalarType dtype, const at::Tensor &x, const at::Tensor &w,
                             const std::optional<at::Tensor> &b, Call call) {
    // The C code trusts its sizes: a wrong one would read outside the tensors.
    const bool ok = x.dim() == 2 && w.dim() == 2 && x.scalar_type() == dtype && w.scalar_type() == dtype &&
                    w.size(1) == x.size(1) && w.is_contiguous() && (!b || (b->dim() == 1 && b->size(0) == w.size(0)));
    TORCH_CHECK_VALUE(ok, op, ": x ", shape(x), " ", x.scalar_type(), ", w ", shape(w), " ", w.scalar_type(), ", b ",
                      b ? shape(*b) : std::string("None"), " must be x (M, K), w (R, K) contiguous, b (R,), ",
                      dtype == at::kFloat ? "fp32" : "bf16");
    const int64_t M = x.size(0), K = x.size(1), R = w.size(0);
    std::optional<at::Tensor> bias;
    if (b) bias = b->to(at::kFloat).contiguous();
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty({M, R}, x.options().dtype(at::kFloat));
    call(xc.const_data_ptr(), w.const_data_ptr(), bias ? bias->const_data_ptr<float>() : nullptr, M, R, K,
         out.mutable_data_ptr<float>());
    return out;
}

at::Tensor rows_mm(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &b) {
    return rows_times_weight("rows_mm", at::kFloat, x, w, b,
                             [](const void *xp, const void *wp, const float *bp, int64_t M, int64_t R, int64_t K,
                                float *out) {
                                 rows_fn(static_cast<const float *>(xp), static_cast<const float *>(wp), bp, M, R, K, out);
                             });
}

at::Tensor bf16_gemv(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &b) {
    return rows_times_weight("bf16 gemv", at::kBFloat16, x, w, b, gemv_fn);
}

// The checks of the MXFP4 ops' Python wrapper (_check_matvec_args): -> the expert ids as int64.
at::Tensor mxfp4_checked(const at::Tensor &x, const at::Tensor &blocks, const at::Tensor &scales,
                         const at::Tensor &experts, const std::optional<at::Tensor> &bias) {
    bool ok = x.dim() == 2 && scales.dim() == 3 && blocks.dim() == 4 && experts.dim() == 1 &&
              blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte &&
              at::isFloatingType(x.scalar_type());
    if (ok) {
        const int64_t E = scales.size(0), R = scales.size(1), G = scales.size(2);
        ok = x.size(1) == 32 * G && blocks.size(0) == E && blocks.size(1) == R && blocks.size(2) == G &&
             blocks.size(3) == 16 && experts.size(0) == x.size(0) &&
             (experts.scalar_type() == at::kLong || experts.scalar_type() == at::kInt);
    }
    TORCH_CHECK_VALUE(ok, "mxfp4 matvec: x ", shape(x), ", blocks ", shape(blocks), ", scales ", shape(scales),
                      " and experts ", shape(experts),
                      " do not fit (x (M, 32·G), blocks (E, R, G, 16) and scales (E, R, G) uint8, experts (M,))");
    const int64_t M = x.size(0), E = scales.size(0), R = scales.size(1);
    at::Tensor ids = experts.to(at::kLong).contiguous();
    const int64_t *id = ids.const_data_ptr<int64_t>();
    for (int64_t m = 0; m < M; m++)  // the C code trusts its indices: a bad one would read outside the codes
        TORCH_CHECK_VALUE(id[m] >= 0 && id[m] < E, "mxfp4 matvec: expert ids must be in [0, ", E, "); got ", id[m]);
    TORCH_CHECK_VALUE(!bias || (bias->dim() == 2 && bias->size(0) == E && bias->size(1) == R), "mxfp4 matvec: bias ",
                      shape(*bias), " must be (E, R) = [", E, ", ", R, "]");
    return ids;
}

// x as the MXFP4 kernels read it: bf16 as it is where they take it (the int8 path always does), else fp32
at::Tensor mxfp4_input(const at::Tensor &x, bool int8, bool *x_bf16) {
    *x_bf16 = x.scalar_type() == at::kBFloat16 && (int8 || mxfp4_bf16_dot);
    return *x_bf16 ? x.contiguous() : x.to(at::kFloat).contiguous();
}

at::Tensor mxfp4_products(const at::Tensor &x, const at::Tensor &blocks, const at::Tensor &scales,
                          const at::Tensor &experts, const std::optional<at::Tensor> &bias, bool int8) {
    const at::Tensor ids = mxfp4_checked(x, blocks, scales, experts, bias);
    const int64_t M = x.size(0), E = scales.size(0), R = scales.size(1), G = scales.size(2);
    std::optional<at::Tensor> bf;
    if (bias) bf = bias->to(at::kFloat).contiguous();
    bool x_bf16 = false;
    const at::Tensor xc = mxfp4_input(x, int8, &x_bf16);
    const at::Tensor bc = blocks.contiguous(), sc = scales.contiguous();
    at::Tensor out = at::empty({M, R}, x.options().dtype(at::kFloat));
    (int8 ? mxfp4_int8_fn : mxfp4_fn)(xc.const_data_ptr(), x_bf16, bc.const_data_ptr(), sc.const_data_ptr(),
                                      ids.const_data_ptr<int64_t>(), bf ? bf->const_data_ptr<float>() : nullptr, M, E,
                                      R, G, out.mutable_data_ptr<float>());
    return out;
}

at::Tensor mxfp4_gate_up_act(const at::Tensor &x, const at::Tensor &blocks, const at::Tensor &scales,
                             const at::Tensor &experts, const std::optional<at::Tensor> &bias, bool swiglu,
                             double limit, bool int8) {
    const at::Tensor ids = mxfp4_checked(x, blocks, scales, experts, bias);
    const int64_t M = x.size(0), E = scales.size(0), R = scales.size(1), G = scales.size(2);
    const bool out_bf16 = x.scalar_type() == at::kBFloat16;
    TORCH_CHECK_VALUE((out_bf16 || x.scalar_type() == at::kFloat) && R % 2 == 0,
                      "mxfp4 gate_up_act: x must be fp32 or bf16 (got ", x.scalar_type(),
                      ") and the rows (gate, up) pairs (got ", R, ")");
    // a bf16 bias is read as it is: only the rows of the experts in use, not a converted copy of all
    std::optional<at::Tensor> bc;
    if (bias) bc = bias->scalar_type() == at::kBFloat16 ? bias->contiguous() : bias->to(at::kFloat).contiguous();
    bool x_bf16 = false;
    const at::Tensor xc = mxfp4_input(x, int8, &x_bf16);
    const at::Tensor blc = blocks.contiguous(), sc = scales.contiguous();
    at::Tensor out = at::empty({M, R / 2}, x.options());
    const int code = gate_up_act_fn(xc.const_data_ptr(), x_bf16, int8, blc.const_data_ptr(), sc.const_data_ptr(),
                                    ids.const_data_ptr<int64_t>(), ptr_or_null(bc),
                                    bc && bc->scalar_type() == at::kBFloat16, M, E, R, G, swiglu,
                                    static_cast<float>(limit), out_bf16, out.mutable_data_ptr());
    TORCH_CHECK(code == 0, "mxfp4 gate_up_act: this build has no such kernel");
    return out;
}

at::Tensor mxfp4_matvec(const at::Tensor &x, const at::Tensor &blocks, const at::Tensor &scales,
                        const at::Tensor &experts, const std::optional<at::Tensor> &bias) {
    return mxfp4_products(x, blocks, scales, experts, bias, false);
}

at::Tensor mxfp4_matvec_int8(const at::Tensor &x, const at::Tensor &blocks, const at::Tensor &scales,
                             const at::Tensor &experts, const std::optional<at::Tensor> &bias) {
    return mxfp4_products(x, blocks, scales, experts, bias, true);
}

at::Tensor moe_experts(const at::Tensor &h, const at::Tensor &idx, const at::Tensor &weights,
                       const at::Tensor &gate_up, const std::optional<at::Tensor> &gate_up_bias,
                       const at::Tensor &down, const std::optional<at::Tensor> &down_bias, bool swiglu, double limit) {
    const bool served = (h.scalar_type() == at::kFloat && moe_isa >= 1) || (h.scalar_type() == at::kBFloat16 && moe_isa >= 2);
    bool ok = h.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && idx.dim() == 2 && served;
    if (ok) {
        const int64_t B = h.size(0), C = h.size(1), E = gate_up.size(0), two_i = gate_up.size(1), A = idx.size(1);
        ok = idx.size(0) == B && weights.dim() == 2 && weights.size(0) == B && weights.size(1) == A &&
             gate_up.size(2) == C && two_i % 2 == 0 && down.size(0) == E && down.size(1) == C &&
             down.size(2) == two_i / 2 &&
             (!gate_up_bias || (gate_up_bias->dim() == 2 && gate_up_bias->size(0) == E && gate_up_bias->size(1) == two_i)) &&
             (!down_bias || (down_bias->dim() == 2 && down_bias->size(0) == E && down_bias->size(1) == C));
        for (const at::Tensor *t : {&gate_up, &down}) ok = ok && t->scalar_type() == h.scalar_type();
        for (const auto *t : {&gate_up_bias, &down_bias}) ok = ok && (!*t || (*t)->scalar_type() == h.scalar_type());
    }
    TORCH_CHECK_VALUE(ok, "moe_experts: h ", shape(h), " ", h.scalar_type(), ", idx ", shape(idx), ", weights ",
                      shape(weights), ", gate_up ", shape(gate_up), ", down ", shape(down),
                      ": not one expert layout this build serves");
    const int64_t B = h.size(0), C = h.size(1), E = gate_up.size(0), I = gate_up.size(1) / 2, A = idx.size(1);
    const at::Tensor x = h.contiguous(), ix = idx.to(at::kLong).contiguous(), w = weights.to(at::kFloat).contiguous();
    const at::Tensor gu = gate_up.contiguous(), dn = down.contiguous();
    std::optional<at::Tensor> gb, db;
    if (gate_up_bias) gb = gate_up_bias->contiguous();
    if (down_bias) db = down_bias->contiguous();
    at::Tensor out = at::empty({B, C}, h.options().dtype(at::kFloat));
    const int code = moe_fn(x.const_data_ptr(), h.scalar_type() == at::kBFloat16, ix.const_data_ptr<int64_t>(),
                            w.const_data_ptr<float>(), B, A, gu.const_data_ptr(), ptr_or_null(gb), dn.const_data_ptr(),
                            ptr_or_null(db), E, C, I, swiglu, static_cast<float>(limit), out.mutable_data_ptr<float>());
    TORCH_CHECK_VALUE(code != -1, "moe_experts: an expert id lies outside [0, ", E, ")");
    TORCH_CHECK(code == 0, "moe_experts: no memory for the grouped rows");
    return out;
}

at::Tensor block_attention(const at::Tensor &rows, const at::Tensor &keys, const at::Tensor &values,
                           const at::Tensor &table, const at::Tensor &distance, int64_t window, const at::Tensor &sinks,
                           bool round_bf16) {
    bool ok = rows.dim() == 4 && keys.dim() == 4 && table.dim() == 2 && distance.dim() == 3 && sinks.dim() == 2;
    if (ok) {
        const int64_t R = rows.size(0), K = rows.size(1), M = rows.size(2), D = rows.size(3), T = distance.size(1);
        ok = keys.size(0) == K && keys.size(3) == D && table.size(0) == R &&
             (distance.size(0) == 1 || distance.size(0) == R) && distance.size(2) == table.size(1) * keys.size(2) &&
             T > 0 && M % T == 0 && sinks.size(0) == K && sinks.size(1) == M / T;
    }
    TORCH_CHECK_VALUE(ok, "block attention: rows ", shape(rows), ", keys ", shape(keys), ", table ", shape(table),
                      ", distance ", shape(distance), ", sinks ", shape(sinks));
    // what the Python wrapper's applies() promises its callers; checked here, where a wrong one would read
    // outside the tensors
    const bool bf16 = keys.scalar_type() == at::kBFloat16;
    TORCH_CHECK_VALUE((bf16 || keys.scalar_type() == at::kFloat) && values.scalar_type() == keys.scalar_type() &&
                          values.sizes() == keys.sizes() && keys.is_contiguous() && values.is_contiguous() &&
                          table.scalar_type() == at::kLong && distance.scalar_type() == at::kLong,
                      "block attention: keys and values must be contiguous fp32 or bf16 storage of one shape, the "
                      "table and distances int64");
    const int64_t R = rows.size(0), K = rows.size(1), M = rows.size(2), D = rows.size(3), T = distance.size(1);
    const at::Tensor x = rows.to(at::kFloat).contiguous(), t = table.contiguous(), dist = distance.contiguous();
    const at::Tensor sk = sinks.to(at::kFloat).contiguous();
    at::Tensor out = at::empty({R, K, M, D}, rows.options().dtype(at::kFloat));
    const int64_t N = keys.size(1), bs = keys.size(2);
    const int code = blocks_fn(x.const_data_ptr<float>(), R, K, M, D, keys.const_data_ptr(), values.const_data_ptr(),
                               bf16, N, bs, t.const_data_ptr<int64_t>(), t.size(1), dist.const_data_ptr<int64_t>(),
                               dist.size(0), T, window, sk.const_data_ptr<float>(), M / T,
                               static_cast<float>(std::pow(static_cast<double>(D), -0.5)), round_bf16,
                               out.mutable_data_ptr<float>());
    TORCH_CHECK_VALUE(code != -1, "block attention: a block id lies outside [0, ", N, ") or the head size exceeds the kernel's");
    TORCH_CHECK(code == 0, "block attention: no memory for the scores");
    return out;
}

std::map<std::string, std::unique_ptr<torch::Library>> registrations;  // op -> its CPU registration

}  // namespace

// Register `op`'s CPU implementation, calling the C function at `fn` (`flags`: the moe kernel's ISA; for
// mxfp4_matvec and mxfp4_gate_up_act, whether the exact kernel takes bf16 inputs).
// 0: registered now or before; 1: an unknown op; 2: registration failed (the reason on stderr).
extern "C" int gl_ops_bind(const char *op, void *fn, int flags) {
    const std::string name(op);
    void **slot = name == "rows_mm"             ? reinterpret_cast<void **>(&rows_fn)
                  : name == "moe_experts"       ? reinterpret_cast<void **>(&moe_fn)
                  : name == "block_attention"   ? reinterpret_cast<void **>(&blocks_fn)
                  : name == "bf16_gemv"         ? reinterpret_cast<void **>(&gemv_fn)
                  : name == "mxfp4_matvec"      ? reinterpret_cast<void **>(&mxfp4_fn)
                  : name == "mxfp4_matvec_int8" ? reinterpret_cast<void **>(&mxfp4_int8_fn)
                  : name == "mxfp4_gate_up_act" ? reinterpret_cast<void **>(&gate_up_act_fn)
                                                : nullptr;
    if (slot == nullptr) return 1;
    if (registrations.count(name)) return 0;
    // the function is in place before the implementation is registered: a call may come as soon as it is
    if (name == "moe_experts") moe_isa = flags;
    if (name == "mxfp4_matvec" || name == "mxfp4_gate_up_act") mxfp4_bf16_dot = flags != 0;
    *slot = fn;
    try {
        auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "gptoss_lite",
                                                    std::optional<c10::DispatchKey>(c10::DispatchKey::CPU), __FILE__,
                                                    __LINE__);
        if (name == "rows_mm") lib->impl("rows_mm", TORCH_FN(rows_mm));
        if (name == "moe_experts") lib->impl("moe_experts", TORCH_FN(moe_experts));
        if (name == "block_attention") lib->impl("block_attention", TORCH_FN(block_attention));
        if (name == "bf16_gemv") lib->impl("bf16_gemv", TORCH_FN(bf16_gemv));
        if (name == "mxfp4_matvec") lib->impl("mxfp4_matvec", TORCH_FN(mxfp4_matvec));
        if (name == "mxfp4_matvec_int8") lib->impl("mxfp4_matvec_int8", TORCH_FN(mxfp4_matvec_int8));
        if (name == "mxfp4_gate_up_act") lib->impl("mxfp4_gate_up_act", TORCH_FN(mxfp4_gate_up_act));
        registrations[name] = std::move(lib);
        return 0;
    } catch (const std::exception &e) {
        fprintf(stderr, "gptoss-lite: registering %s failed: %s\n", op, e.what());
        return 2;
    }
}

// Take `op`'s C++ implementation out of the dispatcher again (its Python implementation serves the next
// call); for in-process comparisons, with no call of the op in flight. 0: done or not registered.
extern "C" int gl_ops_unbind(const char *op) {
    registrations.erase(std::string(op));
    return 0;
}
