"""
fp16's dynamic loss scale, as torch.amp's GradScaler keeps it: backward multiplies the loss by
the scale so small gradients survive fp16; a step skipped for non-finite gradients halves it,
and scale_window clean steps in a row double it. The skip itself is the engine's (any dtype).
"""
import torch


class LossScaler:
    """The loss scale backward multiplies by (1.0 but for fp16)."""

    def __init__(self, dtype, loss_scale, scale_window):
        self.fp16 = dtype == torch.float16          # only fp16 needs a scale
        self.scale = loss_scale if self.fp16 else 1.0  # the loss is multiplied by this
        self.scale_window = scale_window            # fp16: clean steps before the scale doubles
        self.clean_steps = 0                        # fp16: steps since the last overflow

    def took_step(self):
        """A step was taken: fp16 doubles its scale after scale_window clean steps."""
        if self.fp16:
            self.clean_steps += 1
            if self.clean_steps % self.scale_window == 0:
                self.scale *= 2

    def skipped_step(self):
        """A step was skipped: fp16 halves its scale. -> a note for the engine's warning."""
        if not self.fp16:
            return ""
        self.scale, self.clean_steps = self.scale / 2, 0
        return f" (fp16 loss scale now {self.scale:g})"
