#include "nn/context.h"

#include "kernels/ops.h"
#include "tensor/dispatch.h"

namespace loom {

void scale_in_place(Context& ctx, Tensor& x, double s) {
  if (s == 1) return;
  dispatch_float(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ops::scale_inplace<T>(ctx.exec(), x.data<T>(), static_cast<T>(s), x.numel());
  });
}

}  // namespace loom
