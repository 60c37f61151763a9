"""Float32 master weights for a trainer that computes in bfloat16 (mixed-precision training, DESIGN C9).

The PPO trainer computes `evaluate()` in the rollout's precision (bf16 blocks, fp32 islands), so that update 0
has ratio 1 up to batch-shape rounding; but a learning rate of 5e-6 is far below bf16's resolution, so the
optimizer must step float32 copies. `MasterWeights` keeps one float32 master per low-precision trainable
parameter (a float32 parameter is its own master): gradients go master-ward after `backward()`, the updated
masters are rounded back into the model after the optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class MasterWeights:
    """Float32 masters of a model's trainable parameters, for the optimizer.

    Example:
        >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> master = MasterWeights(model.parameters())
        >>> optimizer = torch.optim.SGD(master.parameters(), lr=0.1)
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> master.grads_to_masters()       # float32 gradients on the masters (clip them here)
        >>> optimizer.step()
        >>> master.masters_to_model()       # the updated weights, rounded into the model
        >>> model.weight.dtype, master.parameters()[0].dtype
        (torch.bfloat16, torch.float32)
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
            for p in self.model_params
        ]
        self._low = [(m, p) for m, p in zip(self.masters, self.model_params) if m is not p]
        self._own = [m for m, p in zip(self.masters, self.model_params) if m is p]

    def parameters(self) -> list[torch.Tensor]:
        """The float32 tensors the optimizer steps."""
        return self.masters

    def grads_to_masters(self, accumulate: bool = False) -> None:
        """Float32 copies of the model's gradients on the masters; the model's own gradients are released.

        With `accumulate`, a master that already has a gradient gets the model's added to it, in float32 (the
        micro-batches of one minibatch: call it after each backward, zero the masters' gradients between steps).
        A float32 parameter is its own master and autograd adds into its gradient; that gradient is given its own
        storage here, as autograd may have adopted a CUDA graph's static gradient buffer as it (`GraphedEvaluate`),
        which the next replay overwrites before adding it to itself.
        """
        if accumulate:
            for own in self._own:
                if own.grad is not None:
                    own.grad = own.grad.clone()
        copy, add = [], []
        for master, param in self._low:
            if param.grad is None:
                if not accumulate:
                    master.grad = None
            elif accumulate and master.grad is not None:
                add.append((master, param))
            else:
                if master.grad is None:
                    master.grad = torch.empty_like(master)
                copy.append((master, param))
        # one multi-tensor op each (and cast): hundreds of tensors, launch-bound one by one
        if copy:
            torch._foreach_copy_([m.grad for m, _ in copy], [p.grad for _, p in copy])
        if add:
            torch._foreach_add_([m.grad for m, _ in add], [p.grad for _, p in add])
        for _, param in self._low:
            param.grad = None

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Round the masters into the model's parameters (in place: captured graphs and views stay valid)."""
        if self._low:
            torch._foreach_copy_([p for _, p in self._low], [m for m, _ in self._low])
