"""The drafter compatibility report (pipeline/speculation/drafter_check.py, `specbatch check-drafter`).

What was read from an EAGLE-3 / EAGLE-3.1 drafter and its target before any engine
starts, and the result of every named check. A check that failed refuses the drafter
unless it was downgraded to a warning (`speculative.checks_as_warnings`, `--warn-only`).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from schemas.contracts import Contract

CheckStatus = Literal["pass", "fail", "warn", "skip"]
# verified: the drafter declares its target (name or config fingerprint) and it is this one;
# mismatch: it declares another; unverified: it declares nothing, so only shapes were compared
# and a drafter of another target with the same shapes passes them (the probe can tell).
TargetIdentity = Literal["verified", "mismatch", "unverified"]


# The compatibility checks, by the name a CheckResult carries, and what each asserts.
CHECKS: dict[str, str] = {
    "hidden_size": "the drafter's target_hidden_size is the target's hidden_size",
    "aux_layer_ids": "auxiliary layer ids are distinct, within 0..num_hidden_layers and match the drafter's fc",
    "draft_vocab_map": "the draft vocab map (d2t) points only inside the target's vocab",
    "vocab_size": "the drafter's vocab_size is the target's vocab_size",
    "tokenizer": "a tokenizer shipped with the drafter has the target tokenizer's vocabulary",
    "target_name": "the target the drafter declares (name) is this target",
    "target_fingerprint": "the target the drafter declares (config fingerprint) is this target",
}


class DraftVocabMap(Contract):
    """The drafter's draft-to-target vocab map: target id = draft id + d2t[draft id]."""

    source: Literal["d2t", "identity"] = Field(
        description="'d2t' when read from the weights; 'identity' when there is none (draft id = target id)."
    )
    size: int = Field(description="Entries (draft vocab size).")
    min_target_id: int
    max_target_id: int
    distinct_target_ids: int


class DrafterInfo(Contract):
    path: str
    format: Literal["eagle3", "speculators"] = Field(
        description="'eagle3': plain vLLM EAGLE-3 config; 'speculators': speculators_model_type/speculators_config."
    )
    architectures: list[str]
    eagle_version: Literal["3", "3.1"] = Field(description="'3.1' when both fc_norm and norm_output are set.")
    fc_norm: bool
    norm_output: bool
    norm_before_fc: bool
    norm_before_residual: bool
    declared_target_name: Optional[str] = Field(
        description="specbatch_target.name, or speculators_config.verifier.name_or_path."
    )
    declared_target_fingerprint: Optional[str] = Field(description="specbatch_target.config_fingerprint.")
    hidden_size: int
    target_hidden_size: int = Field(description="target_hidden_size, or hidden_size when absent.")
    vocab_size: int
    draft_vocab_size: int
    vocab_map: Optional[DraftVocabMap] = Field(description="Null when the weights could not be read.")
    use_aux_hidden_state: bool
    aux_layer_ids: list[int] = Field(description="As the engine will use them (vLLM's default when unset).")
    aux_layer_ids_source: Literal["config", "eagle_config", "vllm_default"]
    aux_states_expected: Optional[int] = Field(
        description="Auxiliary states the drafter's fc takes (fc.weight in-features / target_hidden_size)."
    )
    max_position_embeddings: Optional[int]
    dtype: Optional[str] = Field(description="torch_dtype / dtype of the config.")
    weights_dtype: Optional[str] = Field(description="Stored dtype of fc.weight.")
    has_embed_tokens: bool = Field(description="False: the drafter shares the target's embedding.")
    num_speculative_tokens: Optional[int] = Field(
        default=None, description="speculators_config.proposal_methods[0].speculative_tokens."
    )
    tokenizer_vocab_sha256: Optional[str] = Field(
        default=None, description="Of a tokenizer.json shipped with the drafter."
    )


class TargetInfo(Contract):
    path: str
    name: Optional[str] = Field(description="The name the target records (or was given); null when unknown.")
    architectures: list[str]
    model_type: Optional[str]
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: Optional[int]
    dtype: Optional[str]
    config_fingerprint: str = Field(description="pipeline.fingerprint.target_config_fingerprint of the target.")
    tokenizer_vocab_sha256: Optional[str]


class CheckResult(Contract):
    name: str = Field(description="One of schemas.drafter.CHECKS: the compatibility checks by name.")
    status: CheckStatus = Field(description="'warn': failed but downgraded; 'skip': nothing to compare.")
    field: Optional[str] = Field(default=None, description="The drafter field checked.")
    drafter_value: Optional[str] = None
    target_value: Optional[str] = None
    message: str


class DrafterReport(Contract):
    """Refused (`ok` false) when any check has status 'fail'."""

    ok: bool
    target_identity: TargetIdentity = Field(
        description=(
            "verified: a declared target name or fingerprint matches; mismatch: one does not; unverified: none "
            "declared."
        )
    )
    target: TargetInfo
    drafter: DrafterInfo
    checks: list[CheckResult]
    warnings: list[str] = Field(description="Messages of the checks downgraded to warnings.")
    notes: list[str] = Field(default_factory=list, description="Information that is not a check.")
    probe: Optional["ProbeResult"] = Field(None, description="With --probe: acceptance measured on the job's rows.")


class ProbeResult(Contract):
    """The drafter probe (pipeline/speculation/probe.py): the job's own rows through one engine with the
    drafter at the job's lengths, before the full run. Refused below `floor`."""

    measured_at: str = Field(description="UTC, ISO 8601.")
    rows: int = Field(description="Rows generated, in one batch.")
    near_limit_rows_skipped: int = Field(
        0, description="Rows read but left out: they end within 2k tokens of max_model_len, where vLLM stops drafting."
    )
    num_speculative_tokens: int = Field(description="The depth probed.")
    max_model_len: int
    prompt_tokens: int
    generated_tokens: int
    seconds: float
    tokens_per_second: float
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: Optional[float] = Field(description="Accepted / draft tokens; null without drafts.")
    mean_acceptance_length: Optional[float] = Field(description="1 + accepted / drafts; null without drafts.")
    accepted_per_position: list[float] = Field(description="Share of drafts whose i-th token was accepted.")
    floor: float = Field(description="speculative.probe.min_mean_acceptance_length.")
    tokens_per_target_pass: Optional[float] = Field(
        None, description="Generated tokens per target decode pass: what speculation saved, grammar cuts included."
    )
    tokens_per_target_floor: Optional[float] = Field(None, description="speculative.probe.min_tokens_per_target_pass.")
    passed: bool = Field(description="At or above both floors.")


DrafterReport.model_rebuild()
