"""A spy for host synchronisation in tests: every read of a tensor value on the host."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Records reads of a tensor value on the host: ``.item()``, ``bool(t)``, ``torch.equal`` as they
    reach the dispatcher, and ``Tensor.tolist`` (answered without dispatching) by wrapping it."""

    OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
           torch.ops.aten.is_nonzero.default)

    def __init__(self, exempt=()):  # exempt: tensors whose reads are allowed (AdamW's step counts)
        super().__init__()
        self.exempt, self.hits = list(exempt), []

    def _exempt(self, args):
        return any(a is e for a in args for e in self.exempt)

    def __enter__(self):
        self._tolist = original = torch.Tensor.tolist
        spy = self

        def tolist(t):
            if not spy._exempt((t,)):
                spy.hits.append("tolist")
            return original(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS and not self._exempt(args):
            self.hits.append(str(func))
        return func(*args, **(kwargs or {}))
