"""ModelSpec: the MoE model a plan is made for (sizes that the cost model and migration need)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ModelSpec"]


class ModelSpec(BaseModel):
    """Sizes of one MoE model. Every MoE layer has the same experts.

    An expert is a gated FFN (gate, up and down projections): ``3 * hidden *
    ffn_hidden`` parameters.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int = Field(default=1, ge=1, le=4096, description="MoE layers")
    num_experts: int = Field(
        default=256, ge=1, le=65536, description="logical experts per layer, E"
    )
    top_k: int = Field(default=8, ge=1, le=64, description="experts per token")
    hidden: int = Field(default=7168, ge=1, description="model width")
    ffn_hidden: int = Field(default=2048, ge=1, description="expert FFN width")
    weight_bytes: int = Field(default=2, ge=1, le=8, description="bytes per weight (bf16 = 2)")
    grad_bytes: int = Field(default=2, ge=1, le=8, description="bytes per gradient element")
    act_bytes: int = Field(default=2, ge=1, le=8, description="bytes per activation element")
    optimizer_bytes: int = Field(
        default=12,
        ge=0,
        le=32,
        description="bytes of optimizer state per parameter (fp32 master + Adam m, v)",
    )
    training: bool = Field(default=True, description="forward + backward (else forward only)")

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.ffn_hidden

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (what a replica copy moves)."""
        return self.expert_params * self.weight_bytes

    @property
    def master_bytes(self) -> int:
        """Bytes moved when a master moves: weights plus optimizer state."""
        return self.expert_params * (self.weight_bytes + self.optimizer_bytes)

    @property
    def grad_bytes_per_expert(self) -> int:
        """Bytes of one expert's gradient (a replica returns this to its master every step)."""
        return self.expert_params * self.grad_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's activation."""
        return self.hidden * self.act_bytes

    @property
    def token_crossings(self) -> int:
        """How many times a routed token crosses its link per step: dispatch + combine,
        doubled for the backward pass when training (the brief's ``c``)."""
        return 4 if self.training else 2

    @property
    def flops_per_token(self) -> int:
        """FLOPs of one token through one expert: 2 per parameter forward, x3 with backward."""
        return 2 * self.expert_params * (3 if self.training else 1)
