// commd's c10d backend as a C++ torch Backend (built on first use by commd/_c10d.py against the
// torch in the process, with torch.utils.cpp_extension; cached per torch version).
//
// Why C++: torch wraps every Work that a backend written in Python returns in a holder that
// forwards only wait() and get_future(). Through it, is_completed() is always false and a receive
// from any source cannot name its sender (Work::sourceRank), so a Python backend must patch torch's
// Work class and refuse `recv(src=None)`. This backend is a thin C++ shell: each c10d call goes to
// the same method of the Python implementation (commd.torch.CommdBackend), and each Work it returns
// is wrapped in CommdWork, which forwards every Work method, not only those two.
//
// Nothing here moves data: the collectives run in the daemon.
//
// It also carries commd's CPU allocator for torch (install_cpu_allocator): large CPU tensors are
// allocated by commd (commd_client::hostmem), so the daemon can run ops on them in place instead
// of staging them through shared memory.

#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <c10/core/CPUAllocator.h>

#if __has_include(<torch/csrc/distributed/c10d/Hooks.hpp>)
#include <torch/csrc/distributed/c10d/Hooks.hpp>  // torch >= 2.15: abort and completion hooks
#define COMMD_TORCH_HOOKS 1
#endif

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace commd {

using c10d::Backend;
using c10d::Work;

namespace {

// A Python reference that may be dropped on any thread (torch frees Works and backends on its
// own threads): the GIL is taken for the decref, and the reference is leaked, not freed, once
// the interpreter is gone (freeing it then would crash at exit).
class PyRef {
 public:
  explicit PyRef(py::object o) : o_(std::move(o)) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (!Py_IsInitialized()) {
      o_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    o_ = py::object();
  }
  const py::object& get() const { return o_; }

 private:
  py::object o_;
};

void flatten(const py::handle& h, std::vector<at::Tensor>& out) {
  if (h.is_none()) {
    return;
  }
  if (THPVariable_Check(h.ptr())) {
    out.push_back(THPVariable_Unpack(h.ptr()));
    return;
  }
  if (py::isinstance<py::sequence>(h) && !py::isinstance<py::str>(h)) {
    for (auto item : py::reinterpret_borrow<py::sequence>(h)) {
      flatten(item, out);
    }
  }
}

// What a backend's hooks are told (torch's hook APIs): shared by the backend and its Works, which
// may outlive it.
struct Hooks {
  std::mutex mu;
  // torch >= 2.15's abort hooks, by id: run before the backend aborts (abort()) and when one of
  // its ops fails with the communicator broken (a lost peer, a timeout, a lost daemon), where
  // the failure is raised. torch asks hooks to be idempotent: one failure may run them more
  // than once.
  std::map<int64_t, std::function<void()>> abort;
  // torch's `_register_on_completion_hook` (ProcessGroupNCCL's): every op's WorkInfo once it
  // finished, failed or not.
  std::vector<std::function<void(std::shared_ptr<c10d::WorkInfo>)>> done;
#ifdef COMMD_TORCH_HOOKS
  // torch >= 2.15's completion hooks, by id: once per op that completed successfully.
  std::map<int64_t, c10d::CompletionHook> completion;
#endif
  std::atomic<bool> any_done{false};
  // The Python implementation of the backend (commd.torch.CommdBackend), asked whether the
  // communicator is broken when an op fails; set by the backend's constructor.
  std::unique_ptr<PyRef> owner;

  // Whether the daemon holds the communicator broken (a lost rank, a timed-out op, a lost
  // daemon): the failures after which torch's backends abort. A mismatched op fails alone (the
  // communicator keeps working), so it runs no abort hook. Called with the GIL held.
  bool broken() {
    if (!owner) {
      return false;
    }
    try {
      return owner->get().attr("get_error")().cast<int>() != 0;
    } catch (py::error_already_set&) {
      return true;  // the daemon cannot be asked: it is gone
    }
  }

  void run_abort() {
    std::vector<std::function<void()>> hs;
    {
      std::lock_guard<std::mutex> g(mu);
      for (auto& [id, h] : abort) {
        hs.push_back(h);
      }
    }
    for (auto& h : hs) {
      try {
        h();
      } catch (...) {
        // A hook's own failure must not replace the op's.
      }
    }
  }
};

#ifdef COMMD_TORCH_HOOKS
constexpr c10d::OpType kAllgatherIntoTensorCoalesced = c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED;
constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else  // torch 2.11 names no such types: a coalesced op
constexpr c10d::OpType kAllgatherIntoTensorCoalesced = c10d::OpType::COALESCED;
constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::COALESCED;
#endif

// The c10d OpType of the Python implementation's method `name`.
c10d::OpType op_type(const char* name) {
  using c10d::OpType;
  static const std::map<std::string, OpType> m = {
      {"broadcast", OpType::BROADCAST},
      {"allreduce", OpType::ALLREDUCE},
      {"allreduce_coalesced", OpType::ALLREDUCE_COALESCED},
      {"reduce", OpType::REDUCE},
      {"allgather", OpType::ALLGATHER},
      {"_allgather_base", OpType::_ALLGATHER_BASE},
      {"allgather_coalesced", OpType::ALLGATHER_COALESCED},
      {"allgather_into_tensor_coalesced", kAllgatherIntoTensorCoalesced},
      {"gather", OpType::GATHER},
      {"gather_single", OpType::GATHER},
      {"scatter", OpType::SCATTER},
      {"reduce_scatter", OpType::REDUCE_SCATTER},
      {"_reduce_scatter_base", OpType::_REDUCE_SCATTER_BASE},
      {"reduce_scatter_tensor_coalesced", kReduceScatterTensorCoalesced},
      {"alltoall_base", OpType::ALLTOALL_BASE},
      {"alltoall", OpType::ALLTOALL},
      {"send", OpType::SEND},
      {"recv", OpType::RECV},
      {"recv_anysource", OpType::RECVANYSOURCE},
      {"barrier", OpType::BARRIER},
      {"coalesced", OpType::COALESCED},
  };
  auto it = m.find(name);
  return it == m.end() ? OpType::UNKNOWN : it->second;
}

}  // namespace

// A Work of the Python implementation, every method forwarded.
class CommdWork : public Work {
 public:
  explicit CommdWork(py::object w, std::shared_ptr<Hooks> hooks = nullptr)
      : w_(std::move(w)), hooks_(std::move(hooks)) {}

  bool isCompleted() override {
    py::gil_scoped_acquire gil;
    return w_.get().attr("is_completed")().cast<bool>();
  }

  bool isSuccess() const override {
    py::gil_scoped_acquire gil;
    return w_.get().attr("is_success")().cast<bool>();
  }

  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    py::object e = w_.get().attr("exception")();
    if (e.is_none()) {
      return nullptr;
    }
    return std::make_exception_ptr(std::runtime_error(py::str(e).cast<std::string>()));
  }

  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    py::object r = py::getattr(w_.get(), "source_rank", py::none());
    if (!r.is_none()) {
      r = r();
    }
    TORCH_CHECK(!r.is_none(),
                "sourceRank() may only be called on work objects that correspond to a recv "
                "or recv-from-any call (commd)");
    return r.cast<int>();
  }

  std::vector<at::Tensor> result() override {
    py::gil_scoped_acquire gil;
    std::vector<at::Tensor> out;
    flatten(w_.get().attr("result")(), out);
    return out;
  }

  void synchronize() override {
    py::gil_scoped_acquire gil;
    w_.get().attr("synchronize")();
  }

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    py::gil_scoped_acquire gil;
    // The Python Works take None (no limit) or a number of milliseconds.
    py::object t = timeout.count() > 0 ? py::object(py::float_(static_cast<double>(timeout.count())))
                                       : py::object(py::none());
    try {
      py::object r = w_.get().attr("wait")(t);
      return r.is_none() ? true : r.cast<bool>();
    } catch (py::error_already_set&) {
      // The op failed and the communicator is broken: the abort hooks run before the error
      // reaches torch.
      if (hooks_ && hooks_->broken()) {
        py::gil_scoped_release nogil;
        hooks_->run_abort();
      }
      throw;
    }
  }

  void abort() override {
    py::gil_scoped_acquire gil;
    py::object f = py::getattr(w_.get(), "abort", py::none());
    if (!f.is_none()) {
      f();
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    py::gil_scoped_acquire gil;
    py::object o = w_.get().attr("get_future")();
    return o.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
  }

  // The Python object, for tests and for code that needs its own attributes.
  py::object impl() const { return w_.get(); }

 private:
  PyRef w_;
  std::shared_ptr<Hooks> hooks_;
};

// The backend: each c10d method calls the Python implementation's method of the same (Python)
// name and wraps the Work it returns. The methods marked "torch >= 2.15" are the newer names of
// the ones beside them; older torch has no such virtual, so there they override nothing and are
// never called (the older name, also here, is).
class CommdBackend : public Backend {
 public:
  CommdBackend(py::object impl, int rank, int size, std::chrono::milliseconds timeout)
      : Backend(rank, size),
        impl_(std::move(impl)),
        options_(c10::make_intrusive<Options>("commd", timeout)) {
    hooks_->owner = std::make_unique<PyRef>(impl_.get());
  }

  py::object impl() const { return impl_.get(); }

  const std::string getBackendName() const override { return "commd"; }

  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }

  bool supportsSplitting() const override { return true; }

  // torch's error query (its watchdogs and torchft ask it; 2.11 and 2.15 have it): what the
  // daemon holds the communicator broken for, as c10d's ErrorType
  // (commd.torch.CommdBackend.get_error).
  c10d::ErrorType getError() override {
    py::gil_scoped_acquire gil;
    return static_cast<c10d::ErrorType>(impl_.get().attr("get_error")().cast<int>());
  }

  // torch's group sequence number (its desync debugging and flight recorder read it; torch
  // 2.11's default throws "does not yet support sequence numbers"): the collectives this
  // backend issued, a coalesced block counting once and send/recv not at all, as NCCL's
  // seqCollective. split_group sets it on each new backend: back to 0.
  void setSequenceNumberForGroup() override { seq_ = 0; }
  uint64_t getSequenceNumberForGroup() override { return seq_; }

  // torch >= 2.15's abort hooks (Hooks::abort).
  bool supportsAbortHooks() const /* override (torch >= 2.15) */ { return true; }

  void registerAbortHook(int64_t id, std::function<void()> hook) /* override (torch >= 2.15) */ {
    std::lock_guard<std::mutex> g(hooks_->mu);
    hooks_->abort[id] = std::move(hook);
  }

  void unregisterAbortHook(int64_t id) /* override (torch >= 2.15) */ {
    std::lock_guard<std::mutex> g(hooks_->mu);
    hooks_->abort.erase(id);
  }

  // torch's completion hook (`ProcessGroup._register_on_completion_hook`, Hooks::done).
  void registerOnCompletionHook(
      std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override {
    std::lock_guard<std::mutex> g(hooks_->mu);
    hooks_->done.push_back(std::move(hook));
    hooks_->any_done = true;
  }

#ifdef COMMD_TORCH_HOOKS
  // torch >= 2.15's completion hooks (Hooks::completion): the key is the Work's address, as a
  // post-hook sees it.
  bool supportsCompletionHooks() const override { return true; }

  void registerCompletionHook(int64_t id, c10d::CompletionHook hook) override {
    std::lock_guard<std::mutex> g(hooks_->mu);
    hooks_->completion[id] = std::move(hook);
    hooks_->any_done = true;
  }

  void unregisterCompletionHook(int64_t id) override {
    std::lock_guard<std::mutex> g(hooks_->mu);
    hooks_->completion.erase(id);
  }
#endif

  // torch's coalescing (`_coalescing_manager(group, device)`, `batch_isend_irecv`): the ops
  // issued between start and end are posted as they come (commd's ops never block the CPU);
  // endCoalescing's Work is all of them.
  bool supportsCoalescing() const override { return true; }

  void startCoalescing() override {
    TORCH_CHECK(!coalescing_, "commd: startCoalescing inside a coalescing block (they do not nest)");
    py::gil_scoped_acquire gil;
    coalesced_ = std::make_unique<PyRef>(py::list());
    coalescing_ = true;
    seq_++;
  }

  c10::intrusive_ptr<Work> endCoalescing() override {
    TORCH_CHECK(coalescing_, "commd: endCoalescing without startCoalescing");
    coalescing_ = false;
    py::gil_scoped_acquire gil;
    py::object works = coalesced_->get();
    coalesced_.reset();
    py::object w = impl_.get().attr("_coalesced_work")(works);
    return track("coalesced", std::move(w));
  }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                     const c10d::BroadcastOptions& opts) override {
    return call("broadcast", tensors, opts);
  }

  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) override {
    return call("allreduce", tensors, opts);
  }

  c10::intrusive_ptr<Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                            const c10d::AllreduceOptions& opts) override {
    return call("allreduce", tensors, opts);  // the Python allreduce takes sparse tensors
  }

  c10::intrusive_ptr<Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    return call("allreduce_coalesced", tensors, opts);
  }

  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors,
                                  const c10d::ReduceOptions& opts) override {
    return call("reduce", tensors, opts);
  }

  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                     std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) override {
    return call("allgather", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> all_gather_single(at::Tensor& output, at::Tensor& input,
                                             const c10d::AllgatherOptions& opts) /* override (torch >= 2.15) */ {
    return call("_allgather_base", output, input, opts);
  }

  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) override {
    return call("_allgather_base", output, input, opts);
  }

  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) override {
    return call("allgather_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> all_gather_single_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) /* override (torch >= 2.15) */ {
    return call("allgather_into_tensor_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return call("allgather_into_tensor_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) override {
    return call("gather", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> gather_single(at::Tensor& output, at::Tensor& input,
                                         const c10d::GatherOptions& opts) /* override (torch >= 2.15) */ {
    return call("gather_single", output, input, opts);
  }

  c10::intrusive_ptr<Work> gather_into_tensor(at::Tensor& output, at::Tensor& input,
                                              const c10d::GatherOptions& opts) /* override (torch >= 2.15) */ {
    return call("gather_single", output, input, opts);
  }

  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) override {
    return call("scatter", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    return call("reduce_scatter", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> reduce_scatter_single(at::Tensor& output, at::Tensor& input,
                                                 const c10d::ReduceScatterOptions& opts) /* override (torch >= 2.15) */ {
    return call("_reduce_scatter_base", output, input, opts);
  }

  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) override {
    return call("_reduce_scatter_base", output, input, opts);
  }

  c10::intrusive_ptr<Work> reduce_scatter_single_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) /* override (torch >= 2.15) */ {
    return call("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return call("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> all_to_all_single(at::Tensor& output, at::Tensor& input,
                                             std::vector<int64_t>& output_splits,
                                             std::vector<int64_t>& input_splits,
                                             const c10d::AllToAllOptions& opts) /* override (torch >= 2.15) */ {
    return call("alltoall_base", output, input, output_splits, input_splits, opts);
  }

  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                         std::vector<int64_t>& output_splits,
                                         std::vector<int64_t>& input_splits,
                                         const c10d::AllToAllOptions& opts) override {
    return call("alltoall_base", output, input, output_splits, input_splits, opts);
  }

  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outputs,
                                    std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) override {
    return call("alltoall", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return call("send", tensors, dst, tag);
  }

  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return call("recv", tensors, src, tag);
  }

  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return call("recv_anysource", tensors, tag);
  }

  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override {
    return call("barrier", opts);
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    py::gil_scoped_acquire gil;
    impl_.get().attr("monitored_barrier")(opts, waitAllRanks);
  }

  // Called on every rank of the parent (members and not) with the child's store; returns the
  // child's backend, or null on a rank outside `ranks`.
  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                    const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override {
    py::gil_scoped_acquire gil;
    std::chrono::milliseconds timeout = opts ? opts->timeout : options_->timeout;
    py::object child = impl_.get().attr("split")(
        store, ranks, static_cast<double>(timeout.count()) / 1000.0,
        opts ? opts->group_name : std::string());
    if (child.is_none()) {
      return nullptr;
    }
    int r = child.attr("rank")().cast<int>();
    int n = child.attr("size")().cast<int>();
    return c10::make_intrusive<CommdBackend>(child, r, n, timeout);
  }

  void setTimeout(std::chrono::milliseconds timeout) override {
    options_->timeout = timeout;
    py::gil_scoped_acquire gil;
    impl_.get().attr("set_timeout")(static_cast<double>(timeout.count()) / 1000.0);
  }

  void abort() override {
    hooks_->run_abort();
    py::gil_scoped_acquire gil;
    impl_.get().attr("abort")();
  }

  void shutdown() override {
    py::gil_scoped_acquire gil;
    impl_.get().attr("shutdown")();
  }

 private:
  template <typename... Args>
  c10::intrusive_ptr<Work> call(const char* name, Args&&... args) {
    py::gil_scoped_acquire gil;
    py::object w = impl_.get().attr(name)(std::forward<Args>(args)...);
    TORCH_CHECK(!w.is_none(), "commd: ", name, " returned no Work");
    if (coalescing_) {
      coalesced_->get().cast<py::list>().append(w);
    } else if (std::strcmp(name, "send") != 0 && std::strcmp(name, "recv") != 0 &&
               std::strcmp(name, "recv_anysource") != 0) {
      seq_++;
    }
    if (coalescing_) {
      return c10::make_intrusive<CommdWork>(std::move(w), hooks_);
    }
    return track(name, std::move(w));
  }

  // The Work of op `name`, its completion told to the completion hooks (if any are registered:
  // otherwise no future is asked for). Called with the GIL held.
  c10::intrusive_ptr<Work> track(const char* name, py::object w) {
    auto work = c10::make_intrusive<CommdWork>(std::move(w), hooks_);
    if (!hooks_->any_done) {
      return work;
    }
    auto fut = work->getFuture();
    const auto started = std::chrono::steady_clock::now();
    const uint64_t seq = seq_;
    const c10d::OpType type = op_type(name);
    const uint64_t key = reinterpret_cast<uintptr_t>(work.get());
    std::shared_ptr<Hooks> hooks = hooks_;
    fut->addCallback([hooks, started, seq, type, key](c10::ivalue::Future& f) {
      const auto finished = std::chrono::steady_clock::now();
      std::vector<std::function<void(std::shared_ptr<c10d::WorkInfo>)>> done;
#ifdef COMMD_TORCH_HOOKS
      std::vector<c10d::CompletionHook> completion;
#endif
      {
        std::lock_guard<std::mutex> g(hooks->mu);
        done = hooks->done;
#ifdef COMMD_TORCH_HOOKS
        if (!f.hasError()) {
          for (auto& [id, h] : hooks->completion) {
            completion.push_back(h);
          }
        }
#endif
      }
      const std::chrono::duration<float> took = finished - started;
      for (auto& h : done) {
        try {
          h(std::make_shared<c10d::WorkInfo>(type, seq, started, finished, took));
        } catch (...) {
          // A hook's own failure must not fail the op.
        }
      }
#ifdef COMMD_TORCH_HOOKS
      for (auto& h : completion) {
        c10d::CompletionHookArgs a;
        a.completionKey = key;
        a.duration_ms = took.count() * 1000.0f;
        try {
          h(a);
        } catch (...) {
        }
      }
#else
      (void)key;
      (void)f;
#endif
    });
    return work;
  }

  PyRef impl_;
  std::shared_ptr<Hooks> hooks_ = std::make_shared<Hooks>();
  c10::intrusive_ptr<Options> options_;
  uint64_t seq_ = 0;
  bool coalescing_ = false;
  std::unique_ptr<PyRef> coalesced_;
};

}  // namespace commd

namespace commd {

// Large CPU allocations (at least `min_bytes`) come from commd's allocator, whose functions
// (from commd._native.host_allocator) are passed in by address; smaller ones, and any that
// allocator cannot serve, go to the allocator that was installed before.
class CpuAllocator final : public c10::Allocator {
 public:
  using AllocFn = void* (*)(size_t);
  // Frees a block of commd's allocator; false (and nothing done) for any other pointer.
  using FreeFn = bool (*)(void*);

  CpuAllocator(c10::Allocator* fallback, AllocFn alloc, FreeFn free, size_t min_bytes)
      : fallback_(fallback), min_bytes_(min_bytes) {
    alloc_ = alloc;
    free_ = free;
    fallback_raw_ = fallback->raw_deleter();
  }

  c10::DataPtr allocate(size_t n) override {
    if (n >= min_bytes_.load(std::memory_order_relaxed)) {
      void* p = alloc_(n);
      if (p != nullptr) {
        return {p, p, &CpuAllocator::release, c10::Device(c10::DeviceType::CPU)};
      }
    }
    return fallback_->allocate(n);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // raw_allocate/raw_deallocate (oneDNN's scratch buffers use them) free through this, so it
  // must take both kinds of pointer: a block goes back to commd, anything else to the
  // previous allocator's raw deleter. Without one, raw_deallocate is refused as before.
  c10::DeleterFnPtr raw_deleter() const override {
    return fallback_raw_ != nullptr ? &CpuAllocator::release_any : nullptr;
  }

  void set_min_bytes(size_t n) { min_bytes_.store(n, std::memory_order_relaxed); }

 private:
  static void release(void* p) { free_(p); }
  static void release_any(void* p) {
    if (!free_(p)) {
      fallback_raw_(p);
    }
  }

  c10::Allocator* fallback_;
  std::atomic<size_t> min_bytes_;
  static inline FreeFn free_ = nullptr;
  static inline c10::DeleterFnPtr fallback_raw_ = nullptr;
  static inline AllocFn alloc_ = nullptr;
};

// Installed once per process, and never destroyed: tensors it made may outlive everything.
CpuAllocator* g_cpu_allocator = nullptr;

}  // namespace commd

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "commd's c10d backend shell (commd/_c10d.cpp)";
  // The Python class of the backends wrap() makes (torch's Backend, downcast by pybind on the
  // way out of torch's getBackend): what torch calls on a backend that splits beyond the c10d
  // virtuals. A process group made with a bound device (init_process_group(device_id=...),
  // which DeepSpeed passes) has new_group() call perform_nocolor_split on the ranks outside the
  // new group, so that NCCL's collective split sees every rank. commd's new groups are new
  // communicators of their members alone (their creator ignores split_from): nothing to do,
  // and without the method those ranks died of an AttributeError.
  py::class_<commd::CommdBackend, c10d::Backend, c10::intrusive_ptr<commd::CommdBackend>>(
      m, "CommdBackendShell")
      .def(
          "perform_nocolor_split", [](commd::CommdBackend&, const py::object&) {},
          py::arg("device"),
          "Nothing: a rank outside a new group takes no part in making it (commd makes it "
          "as a new communicator of its members).")
      // torch 2.11's split_group deep-copies the parent backend's `options` when the caller
      // passes none (ProcessGroupNCCL has the property; without it split_group on a "commd"
      // group raised AttributeError). torch's Backend.Options cannot be deep-copied:
      // commd.torch's subclass can.
      .def_property_readonly(
          "options",
          [](commd::CommdBackend& b) {
            const double secs = static_cast<double>(b.getBackendOptions()->timeout.count()) / 1000.0;
            return py::module_::import("commd.torch").attr("_backend_options")(secs);
          },
          "This backend's options (commd.torch._BackendOptions: torch's Backend.Options, "
          "copyable).");
  m.def(
      "wrap",
      [](py::object impl, int rank, int size, double timeout_s) -> c10::intrusive_ptr<c10d::Backend> {
        auto ms = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
        return c10::make_intrusive<commd::CommdBackend>(std::move(impl), rank, size, ms);
      },
      "A torch Backend whose calls go to `impl` (a commd.torch.CommdBackend).");
  m.def(
      "impl_of",
      [](const c10::intrusive_ptr<c10d::Backend>& b) -> py::object {
        auto* c = dynamic_cast<commd::CommdBackend*>(b.get());
        return c != nullptr ? c->impl() : py::object(py::none());
      },
      "The Python implementation behind a backend made by wrap(), else None.");
  m.def(
      "work_impl",
      [](const c10::intrusive_ptr<c10d::Work>& w) -> py::object {
        auto* c = dynamic_cast<commd::CommdWork*>(w.get());
        return c != nullptr ? c->impl() : py::object(py::none());
      },
      "The Python Work behind a Work of this backend, else None.");
  m.def(
      "install_cpu_allocator",
      [](uintptr_t alloc, uintptr_t free, size_t min_bytes) -> bool {
        if (commd::g_cpu_allocator == nullptr) {
          commd::g_cpu_allocator = new commd::CpuAllocator(
              c10::GetCPUAllocator(), reinterpret_cast<commd::CpuAllocator::AllocFn>(alloc),
              reinterpret_cast<commd::CpuAllocator::FreeFn>(free), min_bytes);
          // Priority 1: above torch's default CPU allocator (0), so it takes effect.
          c10::SetCPUAllocator(commd::g_cpu_allocator, 1);
        }
        commd::g_cpu_allocator->set_min_bytes(min_bytes);
        return c10::GetCPUAllocator() == commd::g_cpu_allocator;
      },
      "Makes commd's allocator (commd._native.host_allocator) torch's CPU allocator for "
      "allocations of at least min_bytes (a later call changes min_bytes); true when it is the CPU allocator now (another "
      "allocator installed at a higher priority keeps its place).");
}
