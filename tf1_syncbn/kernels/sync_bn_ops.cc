// CPU kernels for synchronized batch norm: the whole training step of one
// layer in four kernels around two all-reduces, one pass over the tensor each.
//
//   SyncBnMoments(x)                         -> packed           (1 read)
//       packed = [n, n*mu, M2 + n*mu^2] (float64, 1 + 2C) of the local batch,
//       summed over towers by one all-reduce;
//   SyncBnNormalize(x, packed_sum, gamma, beta)
//                                            -> y, mean, variance, count, inv_std
//       the global statistics from the reduced vector, then
//       y = (x - mean) * gamma * inv_std + beta                  (1 pass);
//   SyncBnGradSums(dy, x, mean, inv_std)     -> packed_grads, dgamma, dbeta
//       dgamma = sum(dy * xhat), dbeta = sum(dy) of the local batch, also packed
//       as [dgamma, dbeta] (float32, 2C) for the backward all-reduce (1 read);
//   SyncBnGradInput(dy, x, mean, inv_std, gamma, grads_sum, count) -> dx
//       dx = gamma * inv_std * (dy - dbeta/n - xhat * dgamma/n)  (1 pass).
//
// Inputs are canonical views [N, S, 1, C] (NHWC) or [N, C, S, 1] (NCHW),
// seen here as [outer, C, inner]. Statistics accumulate in float for blocks
// of rows and in double across blocks; moments are taken around a per-channel
// shift (the first element), so they stay exact when |mean| >> std.
//
// Also the step watchdog, which bounds how long a step may wait in its
// collectives without TensorFlow's per-op timeout (one sleeping thread per
// collective execution, for the whole timeout):
//
//   SyncBnStepWatchdog()  (attrs: timeout_seconds, message)
//       arms a deadline for this step with one process-wide thread; the
//       step's cancellation manager disarms it when the step ends; past the
//       deadline the step's collective executor is aborted, as TensorFlow's
//       own collective timeout does, so every waiting collective fails with
//       DeadlineExceeded and the message;
//   SyncBnArmedWatchdogs() -> int64: how many steps are armed now (tests).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/collective.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tensorflow {
namespace {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

struct Layout {
  int64_t outer, channels, inner;
};

Status GetLayout(const Tensor& x, const std::string& fmt, Layout* layout) {
  if (x.dims() != 4) return errors::InvalidArgument("expected a 4-D view, got ", x.dims());
  if (fmt == "NHWC") {
    *layout = {x.dim_size(0) * x.dim_size(1) * x.dim_size(2), x.dim_size(3), 1};
  } else if (fmt == "NCHW") {
    *layout = {x.dim_size(0), x.dim_size(1), x.dim_size(2) * x.dim_size(3)};
  } else {
    return errors::InvalidArgument("unknown data_format ", fmt);
  }
  return OkStatus();
}

// Runs fn(o0, o1, partial) over shards of the outer dimension; each shard owns
// a vector of `width` doubles that is summed into `total`.
template <typename Fn>
void ShardedSum(OpKernelContext* ctx, const Layout& l, int width, Fn fn,
                std::vector<double>* total) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  const int64_t work = l.outer * l.channels * l.inner;
  const int64_t shards = std::max<int64_t>(
      1, std::min<int64_t>({int64_t{workers->num_threads} * 2, l.outer, work / 16384 + 1}));
  std::vector<std::vector<double>> partial(shards, std::vector<double>(width, 0.0));
  const int64_t per = (l.outer + shards - 1) / shards;
  Shard(workers->num_threads, workers->workers, shards, work / shards + 1,
        [&](int64_t begin, int64_t end) {
          for (int64_t s = begin; s < end; ++s) {
            const int64_t o0 = s * per, o1 = std::min(l.outer, o0 + per);
            if (o0 < o1) fn(o0, o1, partial[s].data());
          }
        });
  total->assign(width, 0.0);
  for (const auto& p : partial)
    for (int i = 0; i < width; ++i) (*total)[i] += p[i];
}

constexpr int64_t kBlock = 256;  // rows accumulated in float before flushing to double
constexpr int kLanes = 8;        // independent float sums along a contiguous run

// Sums two per-element values, pair(k, c, &u, &v) for element k of channel c,
// over every element of each channel. Returns [sum_u (C), sum_v (C)] in double.
// The statistics kernels differ only in what they sum.
template <typename Pair>
std::vector<double> TwoSumsPerChannel(OpKernelContext* ctx, const Layout& l, Pair pair) {
  const int64_t C = l.channels;
  std::vector<double> total;
  ShardedSum(ctx, l, 2 * C, [&](int64_t o0, int64_t o1, double* acc) {
    std::vector<float> a(C, 0.f), b(C, 0.f);
    int64_t rows = 0;
    for (int64_t o = o0; o < o1; ++o) {
      const int64_t base = o * C * l.inner;
      if (l.inner == 1) {  // channels last: vectorize over channels
        for (int64_t c = 0; c < C; ++c) {
          float u, v;
          pair(base + c, c, &u, &v);
          a[c] += u;
          b[c] += v;
        }
      } else {  // channels first: kLanes partial sums vectorize along the run
        for (int64_t c = 0; c < C; ++c) {
          const int64_t off = base + c * l.inner;
          float sa[kLanes] = {0.f}, sb[kLanes] = {0.f};
          int64_t i = 0;
          for (; i + kLanes <= l.inner; i += kLanes) {
            for (int j = 0; j < kLanes; ++j) {
              float u, v;
              pair(off + i + j, c, &u, &v);
              sa[j] += u;
              sb[j] += v;
            }
          }
          for (; i < l.inner; ++i) {
            float u, v;
            pair(off + i, c, &u, &v);
            sa[0] += u;
            sb[0] += v;
          }
          for (int j = 0; j < kLanes; ++j) {
            a[c] += sa[j];
            b[c] += sb[j];
          }
        }
      }
      if (++rows == kBlock || o + 1 == o1) {
        for (int64_t c = 0; c < C; ++c) {
          acc[c] += a[c];
          acc[C + c] += b[c];
          a[c] = b[c] = 0.f;
        }
        rows = 0;
      }
    }
  }, &total);
  return total;
}

// Runs y[k] = f(k, c) for every element k of channel c, sharded over rows.
template <typename T, typename Fn>
void ForEachElement(OpKernelContext* ctx, const Layout& l, T* out, Fn f) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  const int64_t C = l.channels, row = C * l.inner;
  Shard(workers->num_threads, workers->workers, l.outer, row * 3,
        [&](int64_t o0, int64_t o1) {
          for (int64_t o = o0; o < o1; ++o) {
            const int64_t base = o * row;
            if (l.inner == 1) {  // channels last: vectorize over channels
              for (int64_t c = 0; c < C; ++c) out[base + c] = static_cast<T>(f(base + c, c));
              continue;
            }
            for (int64_t c = 0; c < C; ++c) {
              const int64_t off = base + c * l.inner;
              for (int64_t i = 0; i < l.inner; ++i)
                out[off + i] = static_cast<T>(f(off + i, c));
            }
          }
        });
}

Status CheckVector(const Tensor& t, int64_t size, const char* what) {
  if (t.dims() != 1 || t.dim_size(0) != size)
    return errors::InvalidArgument(what, " must have shape [", size, "], got ",
                                   t.shape().DebugString());
  return OkStatus();
}

// What the four statistics kernels share: the data_format attribute, and the
// checks of the inputs they begin with.
class LayoutKernel : public OpKernel {
 public:
  explicit LayoutKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("data_format", &fmt_));
  }

 protected:
  // The layout of x: input 0 of the forward kernels; the gradient kernels
  // begin with dy, x of dy's shape, and x's per-channel mean and inv_std.
  Status InputLayout(OpKernelContext* ctx, bool gradient, Layout* l) const {
    if (!gradient) return GetLayout(ctx->input(0), fmt_, l);
    const Tensor& x = ctx->input(1);
    if (ctx->input(0).shape() != x.shape())
      return errors::InvalidArgument("dy and x must have the same shape");
    TF_RETURN_IF_ERROR(GetLayout(x, fmt_, l));
    TF_RETURN_IF_ERROR(CheckVector(ctx->input(2), l->channels, "mean"));
    return CheckVector(ctx->input(3), l->channels, "inv_std");
  }

 private:
  std::string fmt_;
};

template <typename T>
class SyncBnMomentsOp : public LayoutKernel {
 public:
  using LayoutKernel::LayoutKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    Layout l;
    OP_REQUIRES_OK(ctx, InputLayout(ctx, /*gradient=*/false, &l));
    const int64_t C = l.channels, n = l.outer * l.inner;
    Tensor* packed;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({1 + 2 * C}), &packed));
    auto out = packed->flat<double>();
    out.setZero();
    if (n == 0) return;
    const T* in = x.flat<T>().data();
    std::vector<float> s(C);
    for (int64_t c = 0; c < C; ++c) s[c] = static_cast<float>(in[c * l.inner]);
    const float* sp = s.data();
    const std::vector<double> total =
        TwoSumsPerChannel(ctx, l, [in, sp](int64_t k, int64_t c, float* u, float* v) {
          const float d = static_cast<float>(in[k]) - sp[c];
          *u = d;
          *v = d * d;
        });
    const double dn = static_cast<double>(n);
    out(0) = dn;
    for (int64_t c = 0; c < C; ++c) {
      const double mean_shifted = total[c] / dn;
      const double m2 = std::max(0.0, total[C + c] - total[c] * mean_shifted);
      const double mu = static_cast<double>(s[c]) + mean_shifted;
      out(1 + c) = dn * mu;
      out(1 + C + c) = m2 + dn * mu * mu;
    }
  }
};

template <typename T>
class SyncBnNormalizeOp : public LayoutKernel {
 public:
  explicit SyncBnNormalizeOp(OpKernelConstruction* ctx) : LayoutKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    Layout l;
    OP_REQUIRES_OK(ctx, InputLayout(ctx, /*gradient=*/false, &l));
    const int64_t C = l.channels;
    const Tensor& packed = ctx->input(1);
    const Tensor& gamma = ctx->input(2);
    const Tensor& beta = ctx->input(3);
    OP_REQUIRES_OK(ctx, CheckVector(packed, 1 + 2 * C, "packed moments"));
    OP_REQUIRES_OK(ctx, CheckVector(gamma, C, "gamma"));
    OP_REQUIRES_OK(ctx, CheckVector(beta, C, "beta"));
    Tensor *y, *mean, *variance, *count, *inv_std;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({C}), &mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({C}), &variance));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &count));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({C}), &inv_std));
    // The global statistics: exactly what unpacking in float64 and casting gives.
    const double* p = packed.flat<double>().data();
    const double n = p[0], safe_n = std::max(n, 1.0);
    float* m = mean->flat<float>().data();
    float* var = variance->flat<float>().data();
    float* r = inv_std->flat<float>().data();
    std::vector<float> scale(C), offset(C);
    const float* g = gamma.flat<float>().data();
    const float* b = beta.flat<float>().data();
    for (int64_t c = 0; c < C; ++c) {
      const double mu = p[1 + c] / safe_n;
      m[c] = static_cast<float>(mu);
      var[c] = static_cast<float>(std::max(p[1 + C + c] / safe_n - mu * mu, 0.0));
      r[c] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var[c]) + epsilon_));
      scale[c] = g[c] * r[c];
      offset[c] = b[c];
    }
    count->scalar<float>()() = static_cast<float>(n);
    const T* in = x.flat<T>().data();
    const float *mp = m, *sp = scale.data(), *op = offset.data();
    ForEachElement(ctx, l, y->flat<T>().data(), [in, mp, sp, op](int64_t k, int64_t c) {
      return (static_cast<float>(in[k]) - mp[c]) * sp[c] + op[c];
    });
  }

 private:
  float epsilon_;
};

template <typename T>
class SyncBnGradSumsOp : public LayoutKernel {
 public:
  using LayoutKernel::LayoutKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    Layout l;
    OP_REQUIRES_OK(ctx, InputLayout(ctx, /*gradient=*/true, &l));
    const int64_t C = l.channels;
    Tensor *packed, *dgamma, *dbeta;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({2 * C}), &packed));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({C}), &dgamma));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({C}), &dbeta));
    const T* g = dy.flat<T>().data();
    const T* in = x.flat<T>().data();
    const float* mu = ctx->input(2).flat<float>().data();
    const float* r = ctx->input(3).flat<float>().data();
    const std::vector<double> total =
        TwoSumsPerChannel(ctx, l, [g, in, mu](int64_t k, int64_t c, float* u, float* v) {
          const float d = static_cast<float>(g[k]);
          *u = d;
          *v = d * (static_cast<float>(in[k]) - mu[c]);
        });
    float* out = packed->flat<float>().data();
    float* out_dgamma = dgamma->flat<float>().data();
    float* out_dbeta = dbeta->flat<float>().data();
    for (int64_t c = 0; c < C; ++c) {
      out[c] = out_dgamma[c] = static_cast<float>(total[C + c] * r[c]);
      out[C + c] = out_dbeta[c] = static_cast<float>(total[c]);
    }
  }
};

template <typename T>
class SyncBnGradInputOp : public LayoutKernel {
 public:
  using LayoutKernel::LayoutKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    Layout l;
    OP_REQUIRES_OK(ctx, InputLayout(ctx, /*gradient=*/true, &l));
    const int64_t C = l.channels;
    const Tensor& mean = ctx->input(2);
    const Tensor& inv_std = ctx->input(3);
    const Tensor& gamma = ctx->input(4);
    const Tensor& sums = ctx->input(5);
    const Tensor& count = ctx->input(6);
    OP_REQUIRES_OK(ctx, CheckVector(gamma, C, "gamma"));
    OP_REQUIRES_OK(ctx, CheckVector(sums, 2 * C, "reduced gradient sums"));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(count.shape()),
                errors::InvalidArgument("count must be a scalar"));
    // dx = gamma*r*(dy - dbeta/n - xhat*dgamma/n), xhat = (x - mean)*r
    //    = dy*a + (x - mean)*b + c0
    const float* mu = mean.flat<float>().data();
    const float* r = inv_std.flat<float>().data();
    const float* gm = gamma.flat<float>().data();
    const float* s = sums.flat<float>().data();
    const float inv_n = 1.0f / std::max(count.scalar<float>()(), 1.0f);
    std::vector<float> a(C), b(C), c0(C);
    for (int64_t c = 0; c < C; ++c) {
      a[c] = gm[c] * r[c];
      b[c] = -a[c] * r[c] * s[c] * inv_n;
      c0[c] = -a[c] * s[C + c] * inv_n;
    }
    Tensor* dx;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &dx));
    const T* g = dy.flat<T>().data();
    const T* in = x.flat<T>().data();
    const float *ap = a.data(), *bp = b.data(), *cp = c0.data();
    ForEachElement(ctx, l, dx->flat<T>().data(), [g, in, mu, ap, bp, cp](int64_t k, int64_t c) {
      return static_cast<float>(g[k]) * ap[c] + (static_cast<float>(in[k]) - mu[c]) * bp[c] +
             cp[c];
    });
  }
};

Status VectorOfChannels(InferenceContext* c, int input, DimensionHandle* channels) {
  ShapeHandle x;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(input), 4, &x));
  std::string fmt;
  TF_RETURN_IF_ERROR(c->GetAttr("data_format", &fmt));
  *channels = c->Dim(x, fmt == "NHWC" ? 3 : 1);
  return OkStatus();
}

// One thread for the whole process watches the deadlines of the running
// steps. Allocated once and never destroyed, so that the detached thread
// never outlives its mutex at exit.
//
// Lifetime: a step's collective executor is referenced while its deadline is
// armed, but the executor's manager (owned by the session) is not, and
// CollectiveExecutor::StartAbort reads it. StartAbort wakes the step's
// pending collectives, so the step can end, and its session close, while
// StartAbort still runs here (TensorFlow's own per-op timeout is safe only
// because its op stays pending until its StartAbort returns). So an entry
// stays in the table while it is being aborted, and every step disarms its
// deadline in the clean-up of its step container (StepDisarm below), on the
// thread that ends the step, which waits until an abort in progress is over:
// no step, and so no session, finishes under a running StartAbort. (The
// step's cancellation callback also disarms, early, when the step fails;
// called from within the abort itself, on this thread, it cannot wait.)
class StepWatchdog {
 public:
  using Clock = std::chrono::steady_clock;

  static StepWatchdog& Get() {
    static StepWatchdog* watchdog = new StepWatchdog();
    return *watchdog;
  }

  // Watches `executor` (one step's) for `seconds`; returns the id to disarm.
  int64_t Arm(CollectiveExecutor* executor, double seconds, const std::string& message) {
    executor->Ref();
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(seconds));
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) {
      std::thread([this] {
        {
          std::lock_guard<std::mutex> started(mu_);
          loop_thread_ = std::this_thread::get_id();
        }
        Loop();
      }).detach();
      started_ = true;
    }
    const int64_t id = next_id_++;
    entries_[id] = Entry{deadline, executor, message, false};
    cv_.notify_one();
    return id;
  }

  // The step ended (or is being cancelled): forget its deadline. If the
  // deadline has fired and its abort is running, `wait` waits until it is
  // over: only the step's clean-up, which runs after every op of the step
  // has finished, may wait (a cancellation callback may run inside the abort
  // itself, or hold what the abort needs).
  void Disarm(int64_t id, bool wait) {
    CollectiveExecutor* executor = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto it = entries_.find(id);
      if (it == entries_.end()) return;
      if (it->second.aborting) {
        if (!wait || std::this_thread::get_id() == loop_thread_) return;
        aborted_cv_.wait(lock, [this, id] { return entries_.find(id) == entries_.end(); });
        return;
      }
      executor = it->second.executor;
      entries_.erase(it);
    }
    executor->Unref();
  }

  int64_t Armed() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(entries_.size());
  }

 private:
  struct Entry {
    Clock::time_point deadline;
    CollectiveExecutor* executor;
    std::string message;
    bool aborting;
  };

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      auto next = entries_.end();
      for (auto it = entries_.begin(); it != entries_.end(); ++it) {
        if (!it->second.aborting &&
            (next == entries_.end() || it->second.deadline < next->second.deadline)) {
          next = it;
        }
      }
      if (next == entries_.end()) {
        cv_.wait(lock);
        continue;
      }
      if (Clock::now() < next->second.deadline) {
        cv_.wait_until(lock, next->second.deadline);
        continue;
      }
      const int64_t id = next->first;
      CollectiveExecutor* executor = next->second.executor;
      const std::string message = next->second.message;
      next->second.aborting = true;
      lock.unlock();
      executor->StartAbort(absl::DeadlineExceededError(message));
      executor->Unref();  // before the step may end: see the class comment
      lock.lock();
      entries_.erase(id);
      aborted_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable aborted_cv_;
  std::map<int64_t, Entry> entries_;
  int64_t next_id_ = 0;
  bool started_ = false;
  std::thread::id loop_thread_;
};

constexpr double kMaxTimeoutSeconds = 1e9;

// Disarms a step's deadline when the step's container is cleaned up, at the
// end of the step, waiting for an abort in progress (see StepWatchdog).
class StepDisarm : public ResourceBase {
 public:
  explicit StepDisarm(int64_t id) : id_(id) {}
  ~StepDisarm() override { StepWatchdog::Get().Disarm(id_, /*wait=*/true); }
  std::string DebugString() const override { return "tf1_syncbn step watchdog disarm"; }

 private:
  const int64_t id_;
};

class SyncBnStepWatchdogOp : public OpKernel {
 public:
  explicit SyncBnStepWatchdogOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("timeout_seconds", &timeout_));
    OP_REQUIRES_OK(c, c->GetAttr("message", &message_));
  }

  void Compute(OpKernelContext* ctx) override {
    CollectiveExecutor* executor = ctx->collective_executor();
    CancellationManager* cancellation = ctx->cancellation_manager();
    // No collective executor: the step runs no collective, nothing can wait.
    // A timeout that is not a positive finite number means "no deadline".
    if (executor == nullptr || cancellation == nullptr || !(timeout_ > 0) ||
        !std::isfinite(timeout_)) {
      return;
    }
    // Deadlines are kept in int64 nanoseconds: clamp so that they never overflow
    // (the Python side clamps to the same 1e9 s, about 31 years).
    const double seconds = std::min<double>(timeout_, kMaxTimeoutSeconds);
    ScopedStepContainer* step_container = ctx->step_container();
    if (step_container == nullptr) {
      // Without a step container nothing tells this process when the step
      // ends: arm nothing (the collectives then simply have no deadline).
      return;
    }
    StepWatchdog& watchdog = StepWatchdog::Get();
    const int64_t id = watchdog.Arm(executor, seconds, message_);
    const std::string name = "tf1_syncbn_step_watchdog_" + std::to_string(id);
    const Status created =
        step_container->Create(ctx->resource_manager(), name, new StepDisarm(id));
    if (!created.ok()) {
      watchdog.Disarm(id, /*wait=*/false);
      ctx->SetStatus(created);
      return;
    }
    // A failed or cancelled step disarms at once (its clean-up disarms again).
    const CancellationToken token = cancellation->get_cancellation_token();
    if (!cancellation->RegisterCallback(
            token, [id] { StepWatchdog::Get().Disarm(id, /*wait=*/false); })) {
      watchdog.Disarm(id, /*wait=*/false);  // already cancelled
    }
  }

 private:
  float timeout_;
  std::string message_;
};

class SyncBnArmedWatchdogsOp : public OpKernel {
 public:
  explicit SyncBnArmedWatchdogsOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = StepWatchdog::Get().Armed();
  }
};

}  // namespace

REGISTER_OP("SyncBnStepWatchdog")
    .Attr("timeout_seconds: float")
    .Attr("message: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs);

REGISTER_OP("SyncBnArmedWatchdogs")
    .Output("armed: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape);

REGISTER_KERNEL_BUILDER(Name("SyncBnStepWatchdog").Device(DEVICE_CPU), SyncBnStepWatchdogOp);
REGISTER_KERNEL_BUILDER(Name("SyncBnArmedWatchdogs").Device(DEVICE_CPU), SyncBnArmedWatchdogsOp);

REGISTER_OP("SyncBnMoments")
    .Input("x: T")
    .Output("packed: double")
    .Attr("T: {half, bfloat16, float}")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle channels, twice, packed;
      TF_RETURN_IF_ERROR(VectorOfChannels(c, 0, &channels));
      TF_RETURN_IF_ERROR(c->Multiply(channels, 2, &twice));
      TF_RETURN_IF_ERROR(c->Add(twice, 1, &packed));
      c->set_output(0, c->Vector(packed));
      return OkStatus();
    });

REGISTER_OP("SyncBnNormalize")
    .Input("x: T")
    .Input("packed_sum: double")
    .Input("gamma: float")
    .Input("beta: float")
    .Output("y: T")
    .Output("mean: float")
    .Output("variance: float")
    .Output("count: float")
    .Output("inv_std: float")
    .Attr("T: {half, bfloat16, float}")
    .Attr("epsilon: float")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle channels;
      TF_RETURN_IF_ERROR(VectorOfChannels(c, 0, &channels));
      c->set_output(0, c->input(0));
      c->set_output(1, c->Vector(channels));
      c->set_output(2, c->Vector(channels));
      c->set_output(3, c->Scalar());
      c->set_output(4, c->Vector(channels));
      return OkStatus();
    });

REGISTER_OP("SyncBnGradSums")
    .Input("dy: T")
    .Input("x: T")
    .Input("mean: float")
    .Input("inv_std: float")
    .Output("packed: float")
    .Output("dgamma: float")
    .Output("dbeta: float")
    .Attr("T: {half, bfloat16, float}")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle channels, twice;
      TF_RETURN_IF_ERROR(VectorOfChannels(c, 1, &channels));
      TF_RETURN_IF_ERROR(c->Multiply(channels, 2, &twice));
      c->set_output(0, c->Vector(twice));
      c->set_output(1, c->Vector(channels));
      c->set_output(2, c->Vector(channels));
      return OkStatus();
    });

REGISTER_OP("SyncBnGradInput")
    .Input("dy: T")
    .Input("x: T")
    .Input("mean: float")
    .Input("inv_std: float")
    .Input("gamma: float")
    .Input("sums: float")
    .Input("count: float")
    .Output("dx: T")
    .Attr("T: {half, bfloat16, float}")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      return OkStatus();
    });

#define REGISTER(T)                                                                   \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("SyncBnMoments").Device(DEVICE_CPU).TypeConstraint<T>("T"),                \
      SyncBnMomentsOp<T>);                                                            \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("SyncBnNormalize").Device(DEVICE_CPU).TypeConstraint<T>("T"),              \
      SyncBnNormalizeOp<T>);                                                          \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("SyncBnGradSums").Device(DEVICE_CPU).TypeConstraint<T>("T"),               \
      SyncBnGradSumsOp<T>);                                                           \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("SyncBnGradInput").Device(DEVICE_CPU).TypeConstraint<T>("T"),              \
      SyncBnGradInputOp<T>);

REGISTER(float);
REGISTER(Eigen::half);
REGISTER(bfloat16);

}  // namespace tensorflow
