// Causal self-attention through cuDNN's fused (flash) kernels, for 16-bit tensors on the CUDA
// backend (runtime.attention: auto | cudnn). No T x T matrix exists in memory: the forward
// keeps each query row's log-sum-exp (cuDNN's softmax statistics), the backward recomputes
// the probabilities tile by tile from it and reads the forward's output for each row's
// sum of dO * O.
//
// cuDNN is loaded at run time (dlopen of libcudnn.so.9) and driven through its backend graph
// API (cudnn_graph.h): the engine builds, links and runs without it, and a machine without it
// (or a shape its engines refuse) runs the backend's own attention kernels instead, which the
// caller logs once. The graphs are built once per shape and kept with their execution plans.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "fuyou/elem_type.h"

namespace fuyou::cuda {

class CudnnAttention {
 public:
  // Loads cuDNN and makes a handle that queues on `stream`. Never throws: on failure
  // available() is false and why() says what failed (the library, a symbol, cudnnCreate).
  explicit CudnnAttention(cudaStream_t stream);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  bool available() const { return lib_ != nullptr && handle_ != nullptr; }
  const std::string& why() const { return why_; }
  std::string version() const;    // "cuDNN 9.19.0 (libcudnn.so.9)"
  size_t version_number() const;  // cudnnGetVersion(): 91900 for 9.19.0; 0 when not loaded

  // Queue the forward on the stream: out(B,T,C) and lse(B,H,T) (fp32, the log-sum-exp of each
  // query row's scaled scores) from qkv(B,T,3C) (q | k | v, heads contiguous within each), all
  // of the 16-bit type t. Returns false with *why set, queueing nothing, when cuDNN refuses.
  bool forward(ElemType t, void* out, float* lse, const void* qkv, int B, int T, int C, int H,
               std::string* why);
  // dqkv(B,T,3C) overwritten from dout(B,T,C), the forward's out and lse, and qkv.
  bool backward(ElemType t, void* dqkv, const void* dout, const void* out, const void* qkv,
                const float* lse, int B, int T, int C, int H, std::string* why);

  // Builds both graphs of shape (B, T, C, H) on 16-bit type t and finalizes every tensor and
  // operation descriptor, which needs the library but no device (the operation graph and
  // its plan need one): "" when all finalize, else the library's or the first descriptor's
  // refusal. For tests on machines without a GPU.
  static std::string check_graphs(ElemType t, int B, int T, int C, int H);

  // Largest workspace (plus the backward's row sums) one call takes outside the arena; a batch
  // needing more runs in equal chunks of batch rows (tests lower it to make chunks). One row
  // over it runs if the device has the memory free, else the shape is refused.
  static constexpr size_t kWorkspaceCap = size_t(256) << 20;
  void set_workspace_cap(size_t bytes) { workspace_cap_ = bytes; }

  struct Plan;  // a finalized graph with its execution plan, workspace size and tensor ids

 private:
  using Key = std::tuple<bool, int, int, int, int, int>;  // backward?, type, B, T, C, H
  Plan* plan_for(bool backward, ElemType t, int B, int T, int C, int H, std::string* why);
  Plan* chunked_plan(bool backward, ElemType t, int B, int T, int C, int H, int* rows,
                     std::string* why);
  static bool aligned(std::initializer_list<const void*> bases, std::initializer_list<size_t> steps,
                      int rows, std::string* why);
  bool reserve(const Plan& plan, std::string* why);
  void run(Plan& plan,
           const std::map<int64_t, void*>& ptrs);  // queues it; throws Error if cuDNN fails

  void* lib_ = nullptr;     // the library (process-wide, opened once); null when unavailable
  void* handle_ = nullptr;  // cudnnHandle_t
  cudaStream_t stream_ = nullptr;
  std::string why_;
  std::string lib_name_;
  std::mutex mu_;  // one graph build or launch at a time (a handle is not thread-safe)
  std::map<Key, std::unique_ptr<Plan>> plans_;
  std::map<Key, std::string> refused_;  // shapes cuDNN refused, with its reason
  size_t workspace_cap_ = kWorkspaceCap;
  void* workspace_ = nullptr;  // device memory outside the arena, grown to the largest plan's
  size_t workspace_bytes_ = 0;
};

}  // namespace fuyou::cuda
