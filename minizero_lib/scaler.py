"""
fp16's dynamic loss scale, and the steps skipped for non-finite gradients (any dtype): what
torch.amp's GradScaler does, kept apart from the engine. A first reading can skip this file.
"""
import warnings

import torch


class LossScaler:
    """The loss scale backward multiplies by, and the count of skipped steps."""

    def __init__(self, dtype, loss_scale, scale_window, skip_limit):
        self.fp16 = dtype == torch.float16          # only fp16 needs a scale
        self.scale = loss_scale if self.fp16 else 1.0  # the loss is multiplied by this
        self.scale_window = scale_window            # fp16: clean steps before the scale doubles
        self.clean_steps = 0                        # fp16: steps since the last overflow
        self.skip_limit = skip_limit                # raise after this many skipped steps in a row
        self.skipped = 0                            # steps skipped for non-finite gradients
        self.skips_in_row = 0                       # ...since the last step taken

    def took_step(self):
        """A step was taken: fp16 doubles its scale after scale_window clean steps."""
        self.skips_in_row = 0
        if self.fp16:
            self.clean_steps += 1
            if self.clean_steps % self.scale_window == 0:
                self.scale *= 2

    def skipped_step(self, t, where, rank):
        """Step t+1 was skipped on every rank (`where`: which gradients went non-finite): fp16
        halves its scale; the first skip warns on rank 0; skip_limit skips in a row raise."""
        if self.fp16:
            self.scale, self.clean_steps = self.scale / 2, 0
        self.skipped, self.skips_in_row = self.skipped + 1, self.skips_in_row + 1
        if self.skipped == 1 and rank == 0:
            warnings.warn(f"minizero: step {t + 1} skipped on every rank: non-finite gradients on "
                          f"{where}; parameters, moments and step counts are unchanged"
                          + (f" (fp16 loss scale now {self.scale:g})" if self.fp16 else ""))
        if self.skips_in_row >= self.skip_limit:
            raise FloatingPointError(f"{self.skips_in_row} steps in a row skipped for non-finite "
                                     f"gradients (last seen on {where}); the model is as it was "
                                     f"after step {t}. Lower the learning rate, check the data, "
                                     f"or raise skip_limit")
