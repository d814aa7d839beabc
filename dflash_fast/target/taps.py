"""The tap rule (spec.md §1-2) in one place: which tensors of the target's forward a layer id and `last` name.

    layer id l (0 <= l < L)  ->  HF hidden_states[l + 1], the output of decoder layer l, kept by a forward hook
                                 (LayerTaps), except id L-1  ->  `last` (the final norm's input)
    `last`                   ->  the residual entering the final norm, captured by a hook (never hidden_states[L],
                                 which most models return AFTER the norm)

Extraction, the online trainer and evaluation all tap the target through LayerTaps.
"""

from typing import Sequence, Tuple

import torch

from dflash_fast.errors import UserError
from dflash_fast.target.norm import final_norm_module


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM, in order: the `layers` beside its final norm (model.layers,
    model.language_model.layers), the first num_hidden_layers of them (as the model's forward runs them)."""
    _, norm_name = final_norm_module(model)
    layers = getattr(model.get_submodule(norm_name.rsplit(".", 1)[0]), "layers", None)
    num_layers = model.config.get_text_config().num_hidden_layers
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) < num_layers:
        raise ValueError(f"{type(model).__name__}: cannot find its {num_layers} decoder layers beside {norm_name} "
                         f"(looked for {norm_name.rsplit('.', 1)[0]}.layers); unsupported target")
    return layers[:num_layers]


class LayerTaps:
    """What a stage keeps of a target forward, by hooks (spec.md §1-2): the outputs of the decoder layers of
    `layer_ids`, each written into one [b, T, K, H] tensor as its layer returns, and `last`, the input of the final
    norm (id L-1 is `last`: HF's hidden_states[L] is after the norm). Unlike output_hidden_states, which holds all
    L + 1 states until the forward returns, nothing else of the forward outlives its layer.

        taps = LayerTaps(model, layer_ids)
        with taps:                      # records the one forward inside
            model(input_ids=ids, logits_to_keep=1)
        hidden, last = taps.take()      # [b, T, K, H], [b, T, H]
    """

    def __init__(self, model, layer_ids: Sequence[int]):
        self.norm, self.norm_name = final_norm_module(model)
        layers = decoder_layers(model)
        self.num_layers, self.num_tapped = len(layers), len(layer_ids)
        self._slots = {}  # decoder layer -> its positions k among layer_ids
        for k, layer in enumerate(layer_ids):
            self._slots.setdefault(layer, []).append(k)
        for layer in self._slots:
            if layer < self.num_layers - 1:
                layers[layer].register_forward_hook(lambda _m, _args, out, layer=layer: self._keep(layer, out))
        self.norm.register_forward_pre_hook(self._norm_input)
        self._recording, self._hidden, self._last = False, None, []

    def __enter__(self):
        self._recording, self._hidden, self._last = True, None, []
        return self

    def __exit__(self, *exc):
        self._recording = False

    def _keep(self, layer: int, out) -> None:
        if not self._recording:
            return
        x = out[0] if isinstance(out, tuple) else out  # a layer returns its output, or a tuple led by it
        if self._hidden is None:
            self._hidden = x.new_empty(*x.shape[:-1], self.num_tapped, x.shape[-1])
        for k in self._slots[layer]:
            self._hidden[..., k, :] = x

    def _norm_input(self, _module, args) -> None:
        if self._recording:
            self._last.append(args[0])
            if self.num_layers - 1 in self._slots:
                self._keep(self.num_layers - 1, args[0])

    def take(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(hidden [b, T, K, H], last [b, T, H]) of the forward recorded last; refused unless the final norm ran
        exactly once in it."""
        if len(self._last) != 1:
            raise UserError(f"the final norm {self.norm_name} ran {len(self._last)} times in one forward, not once")
        hidden, last = self._hidden, self._last[0]
        self._hidden, self._last = None, []
        return hidden, last
