// CPU kernels for synchronized batch norm: the two steps that TensorFlow's
// stock CPU kernels can only do in several passes.
//
//   SyncBnMoments(x)                   -> count, shift, mean, m2     (1 read)
//   SyncBnGradSums(dy, x, mean)        -> sum(dy), sum(dy * (x-mean)) (1 read)
//   SyncBnGradInput(dy, x, a, mean, b, c) -> dy*a + (x-mean)*b + c    (1 pass)
//
// Inputs are canonical views [N, S, 1, C] (NHWC) or [N, C, S, 1] (NCHW),
// seen here as [outer, C, inner]. Statistics accumulate in float for blocks
// of rows and in double across blocks; moments are taken around a per-channel
// shift (the first element), so they stay exact when |mean| >> std.

#include <algorithm>
#include <cmath>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tensorflow {
namespace {

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
      } else {
        for (int64_t c = 0; c < C; ++c) {
          const int64_t off = base + c * l.inner;
          float sa = 0.f, sb = 0.f;
          for (int64_t i = 0; i < l.inner; ++i) {
            float u, v;
            pair(off + i, c, &u, &v);
            sa += u;
            sb += v;
          }
          a[c] += sa;
          b[c] += sb;
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

template <typename T>
class SyncBnMomentsOp : public OpKernel {
 public:
  explicit SyncBnMomentsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("data_format", &fmt_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    Layout l;
    OP_REQUIRES_OK(ctx, GetLayout(x, fmt_, &l));
    const int64_t C = l.channels, n = l.outer * l.inner;
    Tensor *count, *shift, *mean, *m2;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &count));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({C}), &shift));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({C}), &mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({C}), &m2));
    count->scalar<float>()() = static_cast<float>(n);
    const T* in = x.flat<T>().data();
    std::vector<float> s(C, 0.f);
    if (n > 0)
      for (int64_t c = 0; c < C; ++c) s[c] = static_cast<float>(in[c * l.inner]);
    const float* sp = s.data();
    const std::vector<double> total =
        TwoSumsPerChannel(ctx, l, [in, sp](int64_t k, int64_t c, float* u, float* v) {
          const float d = static_cast<float>(in[k]) - sp[c];
          *u = d;
          *v = d * d;
        });
    auto out_shift = shift->flat<float>();
    auto out_mean = mean->flat<float>();
    auto out_m2 = m2->flat<float>();
    for (int64_t c = 0; c < C; ++c) {
      const double mu = n > 0 ? total[c] / n : 0.0;
      out_shift(c) = s[c];
      out_mean(c) = static_cast<float>(mu);
      out_m2(c) = static_cast<float>(std::max(0.0, total[C + c] - total[c] * mu));
    }
  }

 private:
  std::string fmt_;
};

template <typename T>
class SyncBnGradSumsOp : public OpKernel {
 public:
  explicit SyncBnGradSumsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("data_format", &fmt_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& mean = ctx->input(2);
    OP_REQUIRES(ctx, dy.shape() == x.shape(),
                errors::InvalidArgument("dy and x must have the same shape"));
    Layout l;
    OP_REQUIRES_OK(ctx, GetLayout(x, fmt_, &l));
    const int64_t C = l.channels;
    OP_REQUIRES(ctx, mean.NumElements() == C, errors::InvalidArgument("mean must be [C]"));
    Tensor *sum_dy, *sum_dy_xmu;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({C}), &sum_dy));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({C}), &sum_dy_xmu));
    const T* g = dy.flat<T>().data();
    const T* in = x.flat<T>().data();
    const float* mu = mean.flat<float>().data();
    const std::vector<double> total =
        TwoSumsPerChannel(ctx, l, [g, in, mu](int64_t k, int64_t c, float* u, float* v) {
          const float d = static_cast<float>(g[k]);
          *u = d;
          *v = d * (static_cast<float>(in[k]) - mu[c]);
        });
    auto out_a = sum_dy->flat<float>();
    auto out_b = sum_dy_xmu->flat<float>();
    for (int64_t c = 0; c < C; ++c) {
      out_a(c) = static_cast<float>(total[c]);
      out_b(c) = static_cast<float>(total[C + c]);
    }
  }

 private:
  std::string fmt_;
};

template <typename T>
class SyncBnGradInputOp : public OpKernel {
 public:
  explicit SyncBnGradInputOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("data_format", &fmt_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    OP_REQUIRES(ctx, dy.shape() == x.shape(),
                errors::InvalidArgument("dy and x must have the same shape"));
    Layout l;
    OP_REQUIRES_OK(ctx, GetLayout(x, fmt_, &l));
    const int64_t C = l.channels;
    const float* coef[4];
    for (int k = 0; k < 4; ++k) {
      const Tensor& t = ctx->input(2 + k);
      OP_REQUIRES(ctx, t.NumElements() == C,
                  errors::InvalidArgument("per-channel inputs must be [C]"));
      coef[k] = t.flat<float>().data();
    }
    Tensor* dx;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &dx));
    const T* g = dy.flat<T>().data();
    const T* in = x.flat<T>().data();
    T* out = dx->flat<T>().data();
    const float *a = coef[0], *mu = coef[1], *b = coef[2], *c0 = coef[3];
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    const int64_t row = C * l.inner;
    Shard(workers->num_threads, workers->workers, l.outer, row * 3,
          [&](int64_t o0, int64_t o1) {
            for (int64_t o = o0; o < o1; ++o) {
              const int64_t base = o * row;
              if (l.inner == 1) {  // channels last: vectorize over channels
                for (int64_t c = 0; c < C; ++c) {
                  const float v = static_cast<float>(g[base + c]) * a[c] +
                                  (static_cast<float>(in[base + c]) - mu[c]) * b[c] + c0[c];
                  out[base + c] = static_cast<T>(v);
                }
                continue;
              }
              for (int64_t c = 0; c < C; ++c) {
                const int64_t off = base + c * l.inner;
                const float ac = a[c], mc = mu[c], bc = b[c], cc = c0[c];
                for (int64_t i = 0; i < l.inner; ++i) {
                  const float v = static_cast<float>(g[off + i]) * ac +
                                  (static_cast<float>(in[off + i]) - mc) * bc + cc;
                  out[off + i] = static_cast<T>(v);
                }
              }
            }
          });
  }

 private:
  std::string fmt_;
};

Status VectorsOfChannels(InferenceContext* c, int outputs) {
  ShapeHandle x;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &x));
  std::string fmt;
  TF_RETURN_IF_ERROR(c->GetAttr("data_format", &fmt));
  auto channels = c->Dim(x, fmt == "NHWC" ? 3 : 1);
  for (int i = 0; i < outputs; ++i) c->set_output(i, c->Vector(channels));
  return OkStatus();
}

}  // namespace

REGISTER_OP("SyncBnMoments")
    .Input("x: T")
    .Output("count: float")
    .Output("shift: float")
    .Output("mean: float")
    .Output("m2: float")
    .Attr("T: {half, bfloat16, float}")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(VectorsOfChannels(c, 4));
      c->set_output(0, c->Scalar());
      return OkStatus();
    });

REGISTER_OP("SyncBnGradSums")
    .Input("dy: T")
    .Input("x: T")
    .Input("mean: float")
    .Output("sum_dy: float")
    .Output("sum_dy_xmu: float")
    .Attr("T: {half, bfloat16, float}")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .SetShapeFn([](InferenceContext* c) { return VectorsOfChannels(c, 2); });

REGISTER_OP("SyncBnGradInput")
    .Input("dy: T")
    .Input("x: T")
    .Input("scale_dy: float")
    .Input("mean: float")
    .Input("scale_x: float")
    .Input("offset: float")
    .Output("dx: T")
    .Attr("T: {half, bfloat16, float}")
    .Attr("data_format: {'NHWC', 'NCHW'} = 'NHWC'")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return OkStatus();
    });

#define REGISTER(T)                                                                   \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("SyncBnMoments").Device(DEVICE_CPU).TypeConstraint<T>("T"),                \
      SyncBnMomentsOp<T>);                                                            \
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
