"""PreServe's request-length regressor: DistilBERT + M prompt-tuning embeddings + a [CLS] regression head.

Input layout per row (right padded; the prompts take the place PreServe gives them, after [SEP]):

    input_ids      [CLS] t1 .. tn [SEP] pad pad            (T columns, L = n + 2 real)
    encoder input  [CLS] t1 .. tn [SEP] P1 .. PM pad pad   (T + M columns, mask 1 on the first L + M)

Built with one gather over cat(word embeddings, prompts): output column j reads token j when j < L, prompt
j - L when L <= j < L + M, and pad column j - M after that. Positions are 0..T+M-1 as usual, so a row's real
tokens and prompts get the same positions whatever the batch's padding: padding never changes a prediction.
All of it is index arithmetic on dynamic shapes, so the ONNX graph keeps dynamic batch and sequence axes.

Target normalisation (configurable): "linear" trains on tokens / target_scale, "log" on log1p(tokens). With the
default L1 loss either way the estimate is the conditional median, which suits MAE and Acc-k. forward()
de-normalises and clamps to [1, max_output_tokens], so both sit in the exported graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from switchyard.router.predictor.convert import DIM, N_LAYERS, distilbert_config, pretrained_distilbert


@dataclass(frozen=True)
class RegressorConfig:
    layers: tuple[int, ...] = tuple(range(N_LAYERS))  # which MiniLM blocks initialise the encoder, in order
    num_prompt_tokens: int = 20  # M: learnable embeddings appended after [SEP]
    head_hidden: int = 256  # FFN head: dim -> head_hidden (GELU, dropout) -> 1
    head_dropout: float = 0.1
    dropout: float = 0.1  # DistilBERT's dropout and attention dropout
    target: str = "linear"  # "linear" (tokens / target_scale) or "log" (log1p(tokens))
    target_scale: float = 1000.0
    max_output_tokens: int = 4096
    init_tokens: float = 256.0  # the head's initial output (set to the training median)
    extra: dict = field(default_factory=dict)  # free-form notes carried into predictor.json

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def to_json(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_json(cls, d: dict) -> RegressorConfig:
        return cls(**{**d, "layers": tuple(d["layers"])})


class LengthRegressor(nn.Module):
    """(input_ids, attention_mask) int64 [B, T] -> predicted output tokens float32 [B], clamped in-graph."""

    def __init__(self, config: RegressorConfig, pretrained: bool = True) -> None:
        super().__init__()
        self.config = config
        if pretrained:
            self.encoder = pretrained_distilbert(config.layers, dropout=config.dropout)
        else:
            from transformers import DistilBertModel

            self.encoder = DistilBertModel(distilbert_config(config.n_layers, config.dropout))
        self.prompts = nn.Parameter(torch.empty(config.num_prompt_tokens, DIM))
        self.init_prompts()
        self.head = nn.Sequential(
            nn.Linear(DIM, config.head_hidden),
            nn.GELU(),
            nn.Dropout(config.head_dropout),
            nn.Linear(config.head_hidden, 1),
        )
        with torch.no_grad():
            self.head[3].weight.mul_(0.1)
            self.head[3].bias.fill_(self.normalise(torch.tensor(float(config.init_tokens))).item())

    def init_prompts(self) -> None:
        """Prompts as random real-vocabulary rows of the word table (Lester et al.: better than random noise); seeded,
        so a model whose encoder weights are loaded afterwards redraws the same rows by calling this again."""
        word = self.encoder.embeddings.word_embeddings.weight
        gen = torch.Generator().manual_seed(0)
        rows = torch.randint(1000, word.shape[0], (self.config.num_prompt_tokens,), generator=gen)
        with torch.no_grad():
            self.prompts.copy_(word.detach()[rows])

    # --- target normalisation ---

    def normalise(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.config.target == "log":
            return torch.log1p(tokens)
        return tokens / self.config.target_scale

    def denormalise(self, raw: torch.Tensor) -> torch.Tensor:
        if self.config.target == "log":
            return torch.expm1(raw)
        return raw * self.config.target_scale

    # --- forward ---
    def with_prompts(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_embeds [B, T+M, D], mask [B, T+M]): the prompts placed right after each row's real tokens."""
        m = self.config.num_prompt_tokens
        batch, seq = input_ids.shape
        tokens = self.encoder.embeddings.word_embeddings(input_ids)
        table = torch.cat([tokens, self.prompts.unsqueeze(0).expand(batch, -1, -1)], dim=1)
        lengths = attention_mask.sum(dim=1, keepdim=True)  # [B, 1]
        j = torch.arange(seq + m, device=input_ids.device).unsqueeze(0)  # [1, T+M]
        index = torch.where(j < lengths, j, torch.where(j < lengths + m, seq + j - lengths, j - m))
        embeds = torch.gather(table, 1, index.unsqueeze(-1).expand(-1, -1, table.shape[-1]))
        return embeds, (j < lengths + m).to(attention_mask.dtype)

    def forward_raw(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The head's output in target space [B] (what the loss sees; no clamp, so no dead gradient)."""
        embeds, mask = self.with_prompts(input_ids, attention_mask)
        hidden = self.encoder(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        return self.head(hidden[:, 0]).squeeze(-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.denormalise(self.forward_raw(input_ids, attention_mask))
        return tokens.clamp(1.0, float(self.config.max_output_tokens))

    # --- training set-up ---
    def freeze(self, trainable_blocks: int = 1) -> None:
        """PreServe: every encoder layer frozen except the last `trainable_blocks`; prompts and head train.

        The prompts sit at the input, so gradients still flow back through the frozen blocks (activation
        gradients only; no weight gradients are kept for them).
        """
        for p in self.encoder.parameters():
            p.requires_grad_(False)
        blocks = self.encoder.transformer.layer
        for block in blocks[len(blocks) - trainable_blocks :]:
            for p in block.parameters():
                p.requires_grad_(True)
        self.prompts.requires_grad_(True)
        for p in self.head.parameters():
            p.requires_grad_(True)

    def unfreeze(self) -> None:
        for p in self.parameters():
            p.requires_grad_(True)

    def param_groups(self, lr: float, prompt_lr: float, weight_decay: float = 0.01) -> list[dict]:
        """AdamW groups: the prompt embeddings get their own (higher) rate, as prompt tuning wants."""
        others = [p for n, p in self.named_parameters() if p.requires_grad and n != "prompts"]
        groups = [{"params": others, "lr": lr, "weight_decay": weight_decay}]
        if self.prompts.requires_grad:
            groups.append({"params": [self.prompts], "lr": prompt_lr, "weight_decay": 0.0})
        return groups

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


def make_student(teacher: LengthRegressor, layers: Sequence[int] = (0, 5)) -> LengthRegressor:
    """A layer-dropped copy of the trained teacher: its embeddings, prompts, head and the chosen blocks, in order.

    Default (0, 5): the first block (closest to the embeddings) and the fine-tuned last one (what the head
    was trained on top of).
    """
    cfg = teacher.config
    n = cfg.n_layers
    layers = [i % n for i in layers]
    student_cfg = RegressorConfig(**{**asdict(cfg), "layers": tuple(cfg.layers[i] for i in layers)})
    student = LengthRegressor(student_cfg, pretrained=False)
    state = teacher.state_dict()
    new_state = {}
    for key, value in state.items():
        if key.startswith("encoder.transformer.layer."):
            old = int(key.split(".")[3])
            if old in layers:
                rest = key.split(".", 4)[4]
                new_state[f"encoder.transformer.layer.{layers.index(old)}.{rest}"] = value.clone()
        else:
            new_state[key] = value.clone()
    student.load_state_dict(new_state)
    return student
