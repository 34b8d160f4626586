// cuDNN's fused causal attention through its backend graph API (see cudnn_attention.h).
//
// The graphs are the patterns cuDNN's runtime-fusion flash-attention engines recognise (the
// same operation graphs cuDNN's own C++ front end lowers its SDPA nodes to on cuDNN 9 before
// the single-operation descriptors):
//   forward:  S = Q K^T * scale; S masked to -inf where key > query; M = rowmax S;
//             E = exp(S - M); Z = rowsum E; lse = M + log Z; O = (E / Z as 16-bit) V
//   backward: Dot = rowsum(dO * O) (* 1); P = exp(Q K^T * scale - lse), masked;
//             dV = P^T dO; dS = P * (dO V^T - Dot) * scale; dK = dS^T Q; dQ = dS K
// The backward is cuDNN's deterministic form (dQ written by the matmul, no fp32 atomics),
// so a step gives the same bits every time, as every other kernel of the engine does.
// Transposes are views: the same tensor described with its last two dimensions and strides
// swapped. Versions of cuDNN differ in the precisions they accept for the mask's index
// operations; plan_for tries the known forms in turn and keeps the first that builds.
#include "kernels/cuda/cudnn_attention.h"

#if __has_include(<cudnn_graph.h>)
#include <cudnn_graph.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <vector>

#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/sizes.h"

namespace fuyou::cuda {
namespace {

// The entry points this file uses, resolved from the loaded library.
struct Api {
  decltype(&cudnnGetVersion) get_version;
  decltype(&cudnnGetErrorString) error_string;
  decltype(&cudnnGetLastErrorString) last_error;
  decltype(&cudnnCreate) create;
  decltype(&cudnnDestroy) destroy;
  decltype(&cudnnSetStream) set_stream;
  decltype(&cudnnBackendCreateDescriptor) create_desc;
  decltype(&cudnnBackendDestroyDescriptor) destroy_desc;
  decltype(&cudnnBackendSetAttribute) set_attr;
  decltype(&cudnnBackendGetAttribute) get_attr;
  decltype(&cudnnBackendFinalize) finalize;
  decltype(&cudnnBackendExecute) execute;
};
Api g_api{};

// A cuDNN call that failed while a graph was built: plan_for turns it into a refusal.
struct Refused {
  std::string what;
};

std::string status_text(cudnnStatus_t s) {
  std::string t = g_api.error_string ? g_api.error_string(s) : str("status ", static_cast<int>(s));
  if (g_api.last_error) {
    char msg[512] = {};
    g_api.last_error(msg, sizeof msg);
    if (msg[0]) t += str(" (", msg, ")");
  }
  return t;
}

void check(cudnnStatus_t s, const char* what) {
  if (s != CUDNN_STATUS_SUCCESS) throw Refused{str(what, ": ", status_text(s))};
}

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  Desc(cudnnBackendDescriptorType_t type, const char* what) : what_(what) {
    check(g_api.create_desc(type, &d_), what);
  }
  ~Desc() {
    if (d_) g_api.destroy_desc(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t n,
            const void* v) {
    check(g_api.set_attr(d_, name, type, n, v), what_);
    return *this;
  }
  Desc& set_i64(cudnnBackendAttributeName_t name, int64_t v) {
    return set(name, CUDNN_TYPE_INT64, 1, &v);
  }
  Desc& set_type(cudnnBackendAttributeName_t name, cudnnDataType_t v) {
    return set(name, CUDNN_TYPE_DATA_TYPE, 1, &v);
  }
  Desc& set_desc(cudnnBackendAttributeName_t name, const Desc& v) {
    cudnnBackendDescriptor_t p = v.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &p);
  }
  void finalize() { check(g_api.finalize(d_), what_); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
  const char* what_;
};

using DescPtr = std::unique_ptr<Desc>;

// The forms tried, in order: the mask's index and comparison precisions, and the type of the
// backward's view of K (a view of 16-bit data, which some versions want typed as such).
struct Form {
  cudnnDataType_t index_prec, compare_prec;
  bool k_view_16bit;
};
constexpr Form kForms[] = {
    {CUDNN_DATA_INT32, CUDNN_DATA_BOOLEAN, false}, {CUDNN_DATA_FLOAT, CUDNN_DATA_BOOLEAN, false},
    {CUDNN_DATA_INT32, CUDNN_DATA_BOOLEAN, true},  {CUDNN_DATA_FLOAT, CUDNN_DATA_BOOLEAN, true},
    {CUDNN_DATA_INT32, CUDNN_DATA_INT32, false},
};

// Tensor ids of the graphs' real (non-virtual) tensors; virtual ones are numbered from 100.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kLse,
  kDO,
  kDQ,
  kDK,
  kDV,
  kDot,
  kScale,
  kNegInf,
  kOne,
};

}  // namespace

struct CudnnAttention::Plan {
  ~Plan() {  // the plan, the graph, then the descriptors, each after those that name it
    plan.reset();
    graph.reset();
    while (!descs.empty()) descs.pop_back();
  }
  std::vector<DescPtr> descs;  // every descriptor of the graph, kept alive with the plan
  DescPtr graph, plan;
  int64_t workspace = 0;  // bytes the plan asks for
  int64_t dot_bytes = 0;  // the backward's fp32 row sums (B H T), placed before it
  std::string form;       // which Form built, for the log
};

namespace {

// Builds the graph of one direction for shape (B, T, C, H) of 16-bit type t.
class GraphBuilder {
 public:
  GraphBuilder(CudnnAttention::Plan& p, cudnnDataType_t io, const Form& form, int B, int T, int C,
               int H)
      : p_(p), io_(io), form_(form), B_(B), T_(T), H_(H), D_(C / H), C_(C) {}

  // A tensor of dims (B, H, rows, cols) and the given strides.
  const Desc& tensor(int64_t uid, cudnnDataType_t type, std::vector<int64_t> dims,
                     std::vector<int64_t> strides, bool is_virtual, bool by_value = false) {
    auto d = std::make_unique<Desc>(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor descriptor");
    const int64_t align = 16;
    const bool v = is_virtual, bv = by_value;
    d->set_type(CUDNN_ATTR_TENSOR_DATA_TYPE, type)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, static_cast<int64_t>(dims.size()),
             dims.data())
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, static_cast<int64_t>(strides.size()),
             strides.data())
        .set_i64(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid)
        .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    if (v) d->set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v);
    if (bv) d->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &bv);
    d->finalize();
    return keep(std::move(d));
  }
  // Virtual fp32 (or `type`) intermediates, packed: (B,H,T,T) scores and (B,H,T,1) row values.
  const Desc& scores(cudnnDataType_t type = CUDNN_DATA_FLOAT) {
    return tensor(next_++, type, {B_, H_, T_, T_}, {int64_t(H_) * T_ * T_, int64_t(T_) * T_, T_, 1},
                  true);
  }
  const Desc& rows(cudnnDataType_t type = CUDNN_DATA_FLOAT, int64_t uid = 0) {
    return tensor(uid ? uid : next_++, type, {B_, H_, T_, 1}, {int64_t(H_) * T_, T_, 1, 1},
                  uid == 0);
  }
  const Desc& scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }
  // Part `part` (0 q, 1 k, 2 v) of packed qkv(B,T,3C), as (B,H,T,D); transposed: (B,H,D,T).
  const Desc& qkv_part(int64_t uid, int part, bool transposed) {
    (void)part;  // the offset is the pointer's; the strides are the same for every part
    const int64_t ld = 3 * int64_t(C_);
    if (transposed) return tensor(uid, io_, {B_, H_, D_, T_}, {T_ * ld, D_, 1, ld}, false);
    return tensor(uid, io_, {B_, H_, T_, D_}, {T_ * ld, D_, ld, 1}, false);
  }
  // out / dout (B,T,C) as (B,H,T,D).
  const Desc& bthd(int64_t uid) {
    return tensor(uid, io_, {B_, H_, T_, D_}, {int64_t(T_) * C_, D_, C_, 1}, false);
  }

  void pointwise(cudnnPointwiseMode_t mode, const Desc& x, const Desc* b, const Desc* t,
                 const Desc& y, cudnnDataType_t prec = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    auto pw = std::make_unique<Desc>(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise descriptor");
    pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode)
        .set_type(CUDNN_ATTR_POINTWISE_MATH_PREC, prec);
    if (axis >= 0) pw->set_i64(CUDNN_ATTR_POINTWISE_AXIS, axis);
    pw->finalize();
    auto op =
        std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation");
    const float one = 1.0f;
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, *pw)
        .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)
        .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    if (b) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    if (t) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    op->finalize();
    keep(std::move(pw));
    ops_.push_back(&keep(std::move(op)));
  }
  void matmul(const Desc& a, const Desc& b, const Desc& c) {
    auto mm = std::make_unique<Desc>(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul descriptor");
    mm->set_type(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT).finalize();
    auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation");
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, *mm)
        .finalize();
    keep(std::move(mm));
    ops_.push_back(&keep(std::move(op)));
  }
  void reduce(cudnnReduceTensorOp_t mode, const Desc& x, const Desc& y) {
    auto r = std::make_unique<Desc>(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction descriptor");
    r->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode)
        .set_type(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT)
        .finalize();
    auto op =
        std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation");
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, *r)
        .finalize();
    keep(std::move(r));
    ops_.push_back(&keep(std::move(op)));
  }
  void reshape(const Desc& x, const Desc& y) {
    auto op =
        std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation");
    op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x)
        .set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y)
        .finalize();
    ops_.push_back(&keep(std::move(op)));
  }
  // s with every key past its query set to -inf: row index >= column index is kept.
  const Desc& causal_mask(const Desc& s) {
    const Desc& row = scores(CUDNN_DATA_INT32);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, row, form_.index_prec, 2);
    const Desc& col = scores(CUDNN_DATA_INT32);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, col, form_.index_prec, 3);
    const Desc& keep_it = scores(CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_CMP_GE, row, &col, nullptr, keep_it, form_.compare_prec);
    const Desc& masked = scores();
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, &neg_inf(), &keep_it, masked);
    return masked;
  }
  const Desc& neg_inf() {
    if (!neg_inf_) neg_inf_ = &scalar(kNegInf);
    return *neg_inf_;
  }
  const Desc& scale() {
    if (!scale_) scale_ = &scalar(kScale);
    return *scale_;
  }

  void build_forward() {
    const Desc& q = qkv_part(kQ, 0, false);
    const Desc& kt = qkv_part(kK, 1, true);
    const Desc& v = qkv_part(kV, 2, false);
    const Desc& s = scores();
    matmul(q, kt, s);
    const Desc& ss = scores();
    pointwise(CUDNN_POINTWISE_MUL, s, &scale(), nullptr, ss);
    const Desc& sm = causal_mask(ss);
    const Desc& mx = rows();
    reduce(CUDNN_REDUCE_TENSOR_MAX, sm, mx);
    const Desc& sub = scores();
    pointwise(CUDNN_POINTWISE_SUB, sm, &mx, nullptr, sub);
    const Desc& e = scores();
    pointwise(CUDNN_POINTWISE_EXP, sub, nullptr, nullptr, e);
    const Desc& z = rows();
    reduce(CUDNN_REDUCE_TENSOR_ADD, e, z);
    const Desc& logz = rows();
    pointwise(CUDNN_POINTWISE_LOG, z, nullptr, nullptr, logz);
    pointwise(CUDNN_POINTWISE_ADD, mx, &logz, nullptr, rows(CUDNN_DATA_FLOAT, kLse));
    const Desc& prob = scores(io_);  // the probabilities enter the second GEMM as 16-bit
    pointwise(CUDNN_POINTWISE_DIV, e, &z, nullptr, prob);
    matmul(prob, v, bthd(kO));
  }

  void build_backward() {
    const Desc& q = qkv_part(kQ, 0, false);
    const Desc& kt = qkv_part(kK, 1, true);
    const Desc& vt = qkv_part(kV, 2, true);
    const Desc& o = bthd(kO);
    const Desc& dout = bthd(kDO);
    const Desc& lse = rows(CUDNN_DATA_FLOAT, kLse);
    // Dot = rowsum(dO * O), a real fp32 (B,H,T,1) buffer.
    const Desc& doo = tensor(next_++, CUDNN_DATA_FLOAT, {B_, H_, T_, D_},
                             {int64_t(H_) * T_ * D_, int64_t(T_) * D_, D_, 1}, true);
    pointwise(CUDNN_POINTWISE_MUL, dout, &o, nullptr, doo);
    const Desc& rsum = rows();
    reduce(CUDNN_REDUCE_TENSOR_ADD, doo, rsum);
    const Desc& dot = rows(CUDNN_DATA_FLOAT, kDot);
    pointwise(CUDNN_POINTWISE_MUL, rsum, &scalar(kOne), nullptr, dot);
    // P = exp(S * scale - lse), masked.
    const Desc& s = scores();
    matmul(q, kt, s);
    const Desc& ss = scores();
    pointwise(CUDNN_POINTWISE_MUL, s, &scale(), nullptr, ss);
    const Desc& sl = scores();
    pointwise(CUDNN_POINTWISE_SUB, ss, &lse, nullptr, sl);
    const Desc& sm = causal_mask(sl);
    const Desc& p = scores();
    pointwise(CUDNN_POINTWISE_EXP, sm, nullptr, nullptr, p);
    // dV = P^T dO, P^T a 16-bit view.
    const int64_t tt = int64_t(T_) * T_;
    const Desc& pt = tensor(next_++, io_, {B_, H_, T_, T_}, {H_ * tt, tt, 1, T_}, true);
    reshape(p, pt);
    const int64_t ld = 3 * int64_t(C_);
    const Desc& dq = tensor(kDQ, io_, {B_, H_, T_, D_}, {T_ * ld, D_, ld, 1}, false);
    const Desc& dk = tensor(kDK, io_, {B_, H_, T_, D_}, {T_ * ld, D_, ld, 1}, false);
    const Desc& dv = tensor(kDV, io_, {B_, H_, T_, D_}, {T_ * ld, D_, ld, 1}, false);
    matmul(pt, dout, dv);
    // dS = P * (dO V^T - Dot) * scale.
    const Desc& dp = scores();
    matmul(dout, vt, dp);
    const Desc& dp1 = scores();
    pointwise(CUDNN_POINTWISE_SUB, dp, &dot, nullptr, dp1);
    const Desc& dp2 = scores();
    pointwise(CUDNN_POINTWISE_MUL, dp1, &p, nullptr, dp2);
    const Desc& ds = scores();
    pointwise(CUDNN_POINTWISE_MUL, dp2, &scale(), nullptr, ds);
    // dK = dS^T Q, dS^T a 16-bit view.
    const Desc& dst = tensor(next_++, io_, {B_, H_, T_, T_}, {H_ * tt, tt, 1, T_}, true);
    reshape(ds, dst);
    matmul(dst, q, dk);
    // dQ = dS K: K as the view of K^T back, written straight to dQ (the deterministic form).
    const Desc& kr = tensor(next_++, form_.k_view_16bit ? io_ : CUDNN_DATA_FLOAT, {B_, H_, T_, D_},
                            {T_ * ld, D_, ld, 1}, true);
    reshape(kt, kr);
    matmul(ds, kr, dq);
    p_.dot_bytes =
        (int64_t(B_) * H_ * T_ * 4 + 255) / 256 * 256;  // the workspace after it stays aligned
  }

  // Whether cuDNN notes the configuration's engine as nondeterministic (atomics). A query
  // that fails filters nothing: the deterministic graph is the main guarantee, and the GPU
  // test checks that two runs agree bit for bit.
  static bool nondeterministic(cudnnBackendDescriptor_t cfg) {
    cudnnBackendDescriptor_t engine = nullptr;
    if (g_api.create_desc(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine) != CUDNN_STATUS_SUCCESS)
      return false;
    int64_t n = 0;
    bool found = false;
    if (g_api.get_attr(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                       &engine) == CUDNN_STATUS_SUCCESS &&
        n == 1) {
      cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
      int64_t count = 0;
      if (g_api.get_attr(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                         CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &count, notes) == CUDNN_STATUS_SUCCESS)
        for (int64_t k = 0; k < count && k < CUDNN_NUMERICAL_NOTE_TYPE_COUNT; ++k)
          found = found || notes[k] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
    }
    g_api.destroy_desc(engine);
    return found;
  }

  // The operation graph, the first engine configuration cuDNN's heuristics offer that
  // finalizes and is not marked nondeterministic, and its workspace size.
  void finish(cudnnHandle_t handle) {
    p_.graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    std::vector<cudnnBackendDescriptor_t> ops;
    for (const Desc* d : ops_) ops.push_back(d->get());
    p_.graph->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle)
        .set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
             static_cast<int64_t>(ops.size()), ops.data())
        .finalize();
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *p_.graph)
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode)
        .finalize();
    int64_t n = 0;
    check(g_api.get_attr(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                         0, &n, nullptr),
          "engine heuristics (count)");
    if (n <= 0) throw Refused{"cuDNN's heuristics offer no engine for this graph"};
    std::vector<DescPtr> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < n; ++i) {
      cfgs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
      raw.push_back(cfgs.back()->get());
    }
    int64_t got = 0;
    check(g_api.get_attr(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                         n, &got, raw.data()),
          "engine heuristics (results)");
    // First the configurations not marked nondeterministic; if none of those builds, the
    // others, with a warning (the GPU test's two runs still have to agree bit for bit).
    std::string last;
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t i = 0; i < got; ++i) {
        if (nondeterministic(cfgs[i]->get()) != (pass == 1)) continue;
        try {
          auto plan =
              std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
          plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle)
              .set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *cfgs[i])
              .finalize();
          int64_t ws = 0, cnt = 0;
          check(g_api.get_attr(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                               CUDNN_TYPE_INT64, 1, &cnt, &ws),
                "execution plan (workspace size)");
          if (pass == 1)
            spdlog::warn(
                "cuDNN attention: the only engine that builds is marked nondeterministic by cuDNN");
          p_.plan = std::move(plan);
          p_.workspace = ws;
          for (auto& c : cfgs) p_.descs.push_back(std::move(c));
          return;
        } catch (const Refused& r) {
          last = r.what;
        }
      }
    throw Refused{str("none of the ", got, " engine configurations builds: ", last)};
  }

 private:
  const Desc& keep(DescPtr d) {
    p_.descs.push_back(std::move(d));
    return *p_.descs.back();
  }

  CudnnAttention::Plan& p_;
  cudnnDataType_t io_;
  Form form_;
  int64_t B_, T_, H_, D_, C_;
  int64_t next_ = 100;
  std::vector<const Desc*> ops_;
  const Desc* neg_inf_ = nullptr;
  const Desc* scale_ = nullptr;
};

std::string form_name(const Form& f) {
  auto n = [](cudnnDataType_t t) {
    return t == CUDNN_DATA_INT32 ? "int32" : t == CUDNN_DATA_BOOLEAN ? "bool" : "float";
  };
  return str("index ", n(f.index_prec), ", compare ", n(f.compare_prec),
             f.k_view_16bit ? ", 16-bit K view" : "");
}

}  // namespace

// Opens cuDNN and resolves the entry points once per process (never closed: plans and
// handles of any backend may hold on to it). Returns the library's handle, or null with *why.
static void* load_cudnn(std::string* lib_name, std::string* why) {
  static std::once_flag once;
  static void* lib = nullptr;
  static std::string name, failure;
  std::call_once(once, [] {
    for (const char* n : {"libcudnn.so.9", "libcudnn_graph.so.9"}) {
      lib = dlopen(n, RTLD_NOW | RTLD_LOCAL);
      if (lib) {
        name = n;
        break;
      }
    }
    if (!lib) {
      const char* e = dlerror();
      failure = str("cuDNN 9 is not installed or not on the library path (dlopen libcudnn.so.9: ",
                    e ? e : "?", ")");
      return;
    }
    const char* missing = nullptr;
    auto sym = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
      if (!fn && !missing) missing = symbol;
    };
    Api api{};
    sym(api.get_version, "cudnnGetVersion");
    sym(api.error_string, "cudnnGetErrorString");
    sym(api.last_error, "cudnnGetLastErrorString");
    sym(api.create, "cudnnCreate");
    sym(api.destroy, "cudnnDestroy");
    sym(api.set_stream, "cudnnSetStream");
    sym(api.create_desc, "cudnnBackendCreateDescriptor");
    sym(api.destroy_desc, "cudnnBackendDestroyDescriptor");
    sym(api.set_attr, "cudnnBackendSetAttribute");
    sym(api.get_attr, "cudnnBackendGetAttribute");
    sym(api.finalize, "cudnnBackendFinalize");
    sym(api.execute, "cudnnBackendExecute");
    const size_t v = api.get_version ? api.get_version() : 0;
    if (missing)
      failure = str(name, " lacks ", missing, " (cuDNN 9's graph API)");
    else if (v < 90000)
      failure = str(name, " is cuDNN ", v, ", older than 9");
    else if (v >= 91000 && v < 91002)
      failure = str("cuDNN ", v, "'s fused attention has known bugs (9.10.0 and 9.10.1)");
    if (!failure.empty()) {
      lib = nullptr;
      return;
    }
    g_api = api;
  });
  *lib_name = name;
  *why = failure;
  return lib;
}

CudnnAttention::CudnnAttention(cudaStream_t stream) : stream_(stream) {
  lib_ = load_cudnn(&lib_name_, &why_);
  if (!lib_) return;
  cudnnHandle_t h = nullptr;
  cudnnStatus_t s = g_api.create(&h);
  if (s == CUDNN_STATUS_SUCCESS) s = g_api.set_stream(h, stream_);
  if (s != CUDNN_STATUS_SUCCESS) {
    why_ = str("cudnnCreate failed: ", status_text(s));
    if (h) g_api.destroy(h);
    lib_ = nullptr;
    return;
  }
  handle_ = h;
}

std::string CudnnAttention::check_graphs(ElemType t, int B, int T, int C, int H) {
  std::string lib_name, why;
  if (!load_cudnn(&lib_name, &why)) return why;
  const cudnnDataType_t io = t == ElemType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  for (bool backward : {false, true}) {
    Plan plan;
    try {
      GraphBuilder g(plan, io, kForms[0], B, T, C, H);
      if (backward)
        g.build_backward();
      else
        g.build_forward();
    } catch (const Refused& r) {
      return str(backward ? "backward" : "forward", ": ", r.what);
    }
  }
  return "";
}

CudnnAttention::~CudnnAttention() {
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) g_api.destroy(static_cast<cudnnHandle_t>(handle_));
}

size_t CudnnAttention::version_number() const { return lib_ ? g_api.get_version() : 0; }

std::string CudnnAttention::version() const {
  if (!lib_) return "cuDNN (not loaded)";
  const size_t v = g_api.get_version();
  return str("cuDNN ", v / 10000, ".", (v / 100) % 100, ".", v % 100, " (", lib_name_, ")");
}

CudnnAttention::Plan* CudnnAttention::plan_for(bool backward, ElemType t, int B, int T, int C,
                                               int H, std::string* why) {
  const Key key{backward, static_cast<int>(t), B, T, C, H};
  if (auto it = plans_.find(key); it != plans_.end()) return it->second.get();
  if (auto it = refused_.find(key); it != refused_.end()) {
    *why = it->second;
    return nullptr;
  }
  std::string reason;
  const int D = H > 0 ? C / H : 0;
  const size_t v = g_api.get_version();
  if (t != ElemType::kBF16 && t != ElemType::kF16)
    reason = "cuDNN's fused attention takes 16-bit tensors";
  else if (D * H != C || D % 8 || D > 256)
    reason = str("head size ", D, " is not a multiple of 8 up to 256");
  else if (T < 2)
    reason = "a sequence of one position";
  else if (backward && v < 91600 && T % 128)
    reason = str(
        "cuDNN ", v,
        " (before 9.16) needs the sequence length a multiple of 128 in the backward; it is ", T);
  if (reason.empty()) {
    const cudnnDataType_t io = t == ElemType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
    const auto t0 = std::chrono::steady_clock::now();
    for (const Form& f : kForms) {
      if (!backward && f.k_view_16bit) continue;  // the forward has no K view
      auto plan = std::make_unique<Plan>();
      try {
        GraphBuilder g(*plan, io, f, B, T, C, H);
        if (backward)
          g.build_backward();
        else
          g.build_forward();
        g.finish(static_cast<cudnnHandle_t>(handle_));
        plan->form = form_name(f);
        // Once per shape and direction: the first step's compile time and the memory it takes.
        spdlog::info(
            "cuDNN attention {} for B {} T {} C {} H {}: built in {:.2f} s ({}), workspace {}",
            backward ? "backward" : "forward", B, T, C, H,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            plan->form, format_size(static_cast<uint64_t>(plan->workspace + plan->dot_bytes)));
        return (plans_[key] = std::move(plan)).get();
      } catch (const Refused& r) {
        reason += str(reason.empty() ? "" : "; ", "[", form_name(f), "] ", r.what);
      }
    }
  }
  refused_[key] = reason;
  *why = reason;
  return nullptr;
}

// Device memory for the plan's workspace and row sums, outside the arena. A shape whose
// memory cannot be had is refused (the kernels run it) before anything is queued.
bool CudnnAttention::reserve(const Plan& plan, std::string* why) {
  const size_t need = static_cast<size_t>(plan.dot_bytes + plan.workspace);
  if (need <= workspace_bytes_) return true;
  if (workspace_) {
    // Queued calls may still use the old buffer: wait for them (a new shape, the first steps).
    if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess)
      throw Error(str("cuDNN attention: cudaStreamSynchronize failed: ", cudaGetErrorString(e)));
    if (cudaError_t e = cudaFree(workspace_); e != cudaSuccess)
      throw Error(str("cuDNN attention: cudaFree failed: ", cudaGetErrorString(e)));
    workspace_ = nullptr;
    workspace_bytes_ = 0;
  }
  if (cudaMalloc(&workspace_, need) != cudaSuccess) {
    cudaGetLastError();  // an out-of-memory error is not sticky: clear it
    workspace_ = nullptr;
    *why = str("no device memory outside the arena for cuDNN's workspace of ", format_size(need),
               " (lower offload.device_memory to leave room)");
    return false;
  }
  workspace_bytes_ = need;
  return true;
}

void CudnnAttention::run(Plan& plan, const std::map<int64_t, void*>& ptrs) {
  std::vector<int64_t> uids;
  std::vector<void*> data;
  for (const auto& [uid, ptr] : ptrs) {
    uids.push_back(uid);
    data.push_back(ptr);
  }
  if (plan.dot_bytes) {
    uids.push_back(kDot);
    data.push_back(workspace_);
  }
  void* ws = static_cast<char*>(workspace_) + plan.dot_bytes;
  try {
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
             static_cast<int64_t>(uids.size()), uids.data())
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
             static_cast<int64_t>(data.size()), data.data())
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws)
        .finalize();
    check(g_api.execute(static_cast<cudnnHandle_t>(handle_), plan.plan->get(), pack.get()),
          "execute");
  } catch (const Refused& r) {
    // A plan that built but does not run is not a shape to fall back from quietly.
    throw Error(str("cuDNN attention: ", r.what));
  }
}

CudnnAttention::Plan* CudnnAttention::chunked_plan(bool backward, ElemType t, int B, int T, int C,
                                                   int H, int* rows, std::string* why) {
  // The deterministic backward's workspace grows with B H T^2: when the whole batch's would
  // pass the cap, take the batch in equal chunks (divisors of B, largest first) until one
  // fits. One batch row over the cap runs if the device has that much free outside the
  // arena; otherwise the shape is refused.
  auto need = [](const Plan* p) { return p->dot_bytes + p->workspace; };
  Plan* plan = plan_for(backward, t, B, T, C, H, why);
  int r = B;
  while (plan && need(plan) > static_cast<int64_t>(workspace_cap_) && r > 1) {
    // The estimate scales with the rows; the divisor below it is tried, then smaller ones.
    int next = static_cast<int>(
        std::max<int64_t>(1, r * static_cast<int64_t>(workspace_cap_) / need(plan)));
    next = std::min(next, r - 1);
    while (B % next) --next;
    r = next;
    plan = plan_for(backward, t, r, T, C, H, why);
  }
  if (!plan) return nullptr;
  if (need(plan) > static_cast<int64_t>(workspace_cap_)) {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) free_b = 0;
    const size_t margin = size_t(64) << 20;  // cuBLAS and the runtime allocate beside us
    if (static_cast<size_t>(need(plan)) + margin > free_b + workspace_bytes_) {
      *why = str("cuDNN's workspace for one batch row is ", format_size(need(plan)),
                 ", more than the ", format_size(free_b), " free outside the arena");
      return nullptr;
    }
  }
  *rows = r;
  return plan;
}

bool CudnnAttention::forward(ElemType t, void* out, float* lse, const void* qkv, int B, int T,
                             int C, int H, std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!available()) return *why = why_, false;
  int rows = 0;
  Plan* plan = chunked_plan(false, t, B, T, C, H, &rows, why);
  if (!plan) return false;
  const size_t e = elem_type_size(t), row_in = size_t(T) * 3 * C * e, row_out = size_t(T) * C * e;
  if (!aligned({qkv, out, lse}, {row_in, row_out, size_t(H) * T * 4, C * e}, rows < B ? rows : 0,
               why) ||
      !reserve(*plan, why))
    return false;
  float scale = 1.0f / std::sqrt(static_cast<float>(C / H)), neg_inf = -INFINITY;
  for (int b = 0; b < B; b += rows) {
    char* in = static_cast<char*>(const_cast<void*>(qkv)) + b * row_in;
    run(*plan, {{kQ, in},
                {kK, in + C * e},
                {kV, in + 2 * C * e},
                {kO, static_cast<char*>(out) + b * row_out},
                {kLse, lse + size_t(b) * H * T},
                {kScale, &scale},
                {kNegInf, &neg_inf}});
  }
  return true;
}

bool CudnnAttention::backward(ElemType t, void* dqkv, const void* dout, const void* out,
                              const void* qkv, const float* lse, int B, int T, int C, int H,
                              std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!available()) return *why = why_, false;
  int rows = 0;
  Plan* plan = chunked_plan(true, t, B, T, C, H, &rows, why);
  if (!plan) return false;
  const size_t e = elem_type_size(t), row_in = size_t(T) * 3 * C * e, row_out = size_t(T) * C * e;
  if (!aligned({qkv, dqkv, out, dout, lse},
               {row_in, row_in, row_out, row_out, size_t(H) * T * 4, C * e}, rows < B ? rows : 0,
               why) ||
      !reserve(*plan, why))
    return false;
  float scale = 1.0f / std::sqrt(static_cast<float>(C / H)), neg_inf = -INFINITY, one = 1.0f;
  for (int b = 0; b < B; b += rows) {
    char* in = static_cast<char*>(const_cast<void*>(qkv)) + b * row_in;
    char* d = static_cast<char*>(dqkv) + b * row_in;
    run(*plan, {{kQ, in},
                {kK, in + C * e},
                {kV, in + 2 * C * e},
                {kO, static_cast<char*>(const_cast<void*>(out)) + b * row_out},
                {kDO, static_cast<char*>(const_cast<void*>(dout)) + b * row_out},
                {kLse, const_cast<float*>(lse) + size_t(b) * H * T},
                {kDQ, d},
                {kDK, d + C * e},
                {kDV, d + 2 * C * e},
                {kScale, &scale},
                {kNegInf, &neg_inf},
                {kOne, &one}});
  }
  return true;
}

// cuDNN's tensors are declared 16-byte aligned: every base, the k / v offsets within a row
// (the last step) and, when the batch runs in chunks of `rows` (0: one chunk), every chunk's
// offset (the other steps, one per base) must be.
bool CudnnAttention::aligned(std::initializer_list<const void*> bases,
                             std::initializer_list<size_t> steps, int rows, std::string* why) {
  for (const void* p : bases)
    if (reinterpret_cast<uintptr_t>(p) % 16) return *why = "a tensor not 16-byte aligned", false;
  auto it = steps.begin();
  for (size_t i = 0; i + 1 < steps.size(); ++i, ++it)
    if (rows && (*it * rows) % 16)
      return *why = "a batch chunk's offset not 16-byte aligned", false;
  if (*it % 16)
    return *why = "k and v not 16-byte aligned within qkv (C * element size % 16)", false;
  return true;
}

}  // namespace fuyou::cuda

#else  // a CUDA toolkit without cuDNN's headers: the kernels run every attention

#include "fuyou/error.h"

namespace fuyou::cuda {

struct CudnnAttention::Plan {};

CudnnAttention::CudnnAttention(cudaStream_t stream)
    : stream_(stream),
      why_("this build found no cuDNN headers (cudnn_graph.h) beside the CUDA toolkit") {}
CudnnAttention::~CudnnAttention() = default;
std::string CudnnAttention::version() const { return "cuDNN (not built)"; }
size_t CudnnAttention::version_number() const { return 0; }
bool CudnnAttention::forward(ElemType, void*, float*, const void*, int, int, int, int,
                             std::string* why) {
  return *why = why_, false;
}
bool CudnnAttention::backward(ElemType, void*, const void*, const void*, const void*, const float*,
                              int, int, int, int, std::string* why) {
  return *why = why_, false;
}
std::string CudnnAttention::check_graphs(ElemType, int, int, int, int) {
  return "this build found no cuDNN headers (cudnn_graph.h) beside the CUDA toolkit";
}

}  // namespace fuyou::cuda

#endif
