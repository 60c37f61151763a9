"""The processed batch that enters the PI0.5 model (and that a rollout stores for `evaluate()`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class ModelInputs:
    """A processed batch of N observations, on the policy's device.

    Images stay uint8 at model resolution (lossless to store, DESIGN C5); the model maps them to [-1, 1].

    Attributes:
        images: (N, n_cams, 3, S, S) uint8, one entry per *used* camera slot, in slot order.
        image_mask: (N, n_cams) bool, False where an env has no image for that slot (masked = removed).
        slots: model slot index of each used camera (static, host-side), e.g. (0, 1) for base + left wrist.
        tokens: (N, L) int32 prompt token ids, BOS first, right-padded with 0 to the prompt bucket L.
        lengths: (N,) int32 number of real tokens per row.
        state: (N, S_state) float32 normalised (un-padded) state, or None (PI0.5 reads state via the prompt).

    Example:
        >>> x = ModelInputs(images=torch.zeros(2, 1, 3, 224, 224, dtype=torch.uint8),
        ...                 image_mask=torch.ones(2, 1, dtype=torch.bool), slots=(0,),
        ...                 tokens=torch.zeros(2, 16, dtype=torch.int32),
        ...                 lengths=torch.tensor([3, 5], dtype=torch.int32))
        >>> x.token_mask.sum().item(), x.batch_size
        (8, 2)
    """

    images: torch.Tensor
    image_mask: torch.Tensor
    slots: tuple[int, ...]
    tokens: torch.Tensor
    lengths: torch.Tensor
    state: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """N."""
        return self.tokens.shape[0]

    @property
    def token_mask(self) -> torch.Tensor:
        """(N, L) bool, True on real tokens."""
        positions = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return positions[None, :] < self.lengths[:, None]

    def select(self, index: torch.Tensor | slice) -> ModelInputs:
        """Rows `index` of every per-env tensor."""
        state = None if self.state is None else self.state[index]
        return replace(
            self,
            images=self.images[index],
            image_mask=self.image_mask[index],
            tokens=self.tokens[index],
            lengths=self.lengths[index],
            state=state,
        )

    def to(self, device: torch.device | str) -> ModelInputs:
        """Copy to `device`."""
        state = None if self.state is None else self.state.to(device)
        return replace(
            self,
            images=self.images.to(device),
            image_mask=self.image_mask.to(device),
            tokens=self.tokens.to(device),
            lengths=self.lengths.to(device),
            state=state,
        )
