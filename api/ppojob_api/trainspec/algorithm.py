"""The training half of a PPOJob: the RL algorithm (`spec.algorithm`): estimator, KL, importance
sampling, dynamic sampling and overlong shaping."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ppojob_api.base import HOOK_PATTERN, ApiModel

from .constants import WHITENING_BY_DEFAULT


class KLSpec(ApiModel):
    """The KL penalty against the reference (initial) policy."""

    coefficient: float = Field(0.0, ge=0)
    """KL coefficient (the initial one when `target` is set). 0 disables the KL term and the
    reference model."""

    estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    """Per-token KL estimator: `k1` = log p - log q, `k2` = (log p - log q)^2 / 2, `k3` = the
    non-negative unbiased estimator, `low_var_kl` = k3 clamped. A KL loss needs k2, k3 or
    low_var_kl."""

    mode: Literal["reward", "loss"] = "reward"
    """`reward`: subtract coefficient x KL from every token's reward; `loss`: add coefficient x KL
    to the policy loss."""

    target: float | None = Field(None, gt=0)
    """Target KL per sequence for the adaptive controller (Ziegler et al. 2019). Unset keeps the
    coefficient fixed. Only with mode `reward`."""

    horizon: int = Field(10000, ge=1)
    """Horizon (in samples) of the adaptive KL controller."""


class ImportanceSampling(ApiModel):
    """Off-policy correction of the decoupled PPO objective: each token's policy loss is weighed
    by w = pi_old / pi_behaviour, where pi_behaviour is the policy that sampled the token (the
    engine's sampling log-prob, of the weights it held then) and pi_old the proximal policy the
    actor recomputes at the start of the step (the PPO ratio's anchor)."""

    level: Literal["token", "sequence"] = "token"
    """`token`: one weight per token; `sequence`: one weight per sample, the product of its
    tokens' ratios, given to every token of the sample."""

    mode: Literal["truncate", "mask"] = "truncate"
    """`truncate` (TIS): w -> min(w, cap); `mask` (MIS): w -> w when w <= cap, else 0 (the token,
    or the whole sample at level sequence, is left out of the loss)."""

    cap: float = Field(2.0, gt=1, le=1000)
    """The bound C of the weights (> 1; 2 is common at level token, larger at level sequence)."""


class DynamicSampling(ApiModel):
    """DAPO's dynamic sampling (Yu et al. 2025, "DAPO", arXiv 2503.14476): a prompt group whose
    samples all got the same reward has zero advantage under a group estimator and teaches
    nothing, so it is left out of the step; the trainer generates more groups (rounds of
    data.rolloutBatchSize fresh prompts) until the step has rolloutBatchSize groups with
    differing rewards, or maxRounds rounds were generated. Every step reports
    dynamic_sampling/generation_rounds, dynamic_sampling/filtered_groups (groups left out),
    dynamic_sampling/kept_groups and dynamic_sampling/short_groups; reward/mean is then over
    every sample generated in the step's rounds."""

    max_rounds: int = Field(4, ge=1, le=64)
    """Generation rounds per step at most, the first included (1: filter, never refill). When the
    cap is hit the step trains on the groups it has: the missing ones are filled with filtered
    groups whose samples are left out of the loss, and dynamic_sampling/short_groups says how
    many were missing."""


class OverlongShaping(ApiModel):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13): with L_max =
    data.maxResponseLength and L_cache = bufferLength, a response of |y| tokens (its stop token
    included) gets the penalty 0 when |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache
    inside the buffer (reaching -1 at L_max) and -1 beyond, times penaltyFactor, added to its
    reward before advantages (and before dynamic sampling compares a group's rewards).
    reward/mean stays the task's reward; reward/overlong_penalty_mean reports the mean
    penalty."""

    buffer_length: int = Field(ge=1, le=1_048_576)
    """L_cache: the last this many tokens below data.maxResponseLength are the punishment
    buffer; must be smaller than data.maxResponseLength (DAPO: 4096 of 20480)."""

    penalty_factor: float = Field(1.0, gt=0, le=100)
    """Scale of the penalty (1 in the paper)."""


class Distillation(ApiModel):
    """On-policy distillation: a teacher model scores the student's (the actor's) own sampled
    responses token by token, and the per-token reverse KL, log pi_student(y_t) - log
    pi_teacher(y_t) (the teacher at temperature 1, no nucleus), is the learning signal, alone
    or beside the data's reward. The teacher is held frozen on every actor worker, beside the
    policy (as the reference is), in its dtype; it must use the actor's tokenizer (the trainer
    refuses another one at start, with the difference). Each step reports
    distill/reverse_kl: the mean over samples of the summed per-token reverse KL."""

    teacher: str = Field(min_length=1)
    """The teacher model, in the forms of model.path (a Hugging Face model directory, a hub id,
    or `builtin:<name>`), or `builtin:count-up-teacher`: a tiny-llama-shaped model built here
    whose next token depends on the current one only (after digit d: d+1 with probability 0.7,
    d+2 with 0.2, each other digit 0.012, a special token 0.001), for CPU runs of the
    count-up task."""

    coefficient: float = Field(1.0, ge=0, le=1000)
    """Weight of the reverse-KL signal. 0 measures the reverse KL (distill/reverse_kl) without
    learning from it."""

    mode: Literal["reward", "loss"] = "reward"
    """`reward`: coefficient x (log pi_teacher - log pi_student) is added to every response
    token's reward before advantages (needs an estimator that reads token rewards: gae,
    reinforce_plus_plus); `loss`: coefficient x 0.5 (log pi_student - log pi_teacher)^2 is
    added to the actor's loss, whose gradient on the student's own samples is the reverse
    KL's."""

    task_reward: bool = True
    """Whether the data's reward (rewardFunction, rewards, or the built-in task's) is part of
    the signal. false: the teacher alone: the reward's scores are left out of the advantages
    (reward/mean still reports the built-in task's reward; a dataset needs no reward
    function, and its reward/mean is 0)."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of the teacher's weights. Unset: model.dtype."""


class Algorithm(ApiModel):
    """The RL algorithm: advantage estimation, clipping, KL and critic schedule."""

    advantage_estimator: Literal[
        "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"
    ] = "gae"
    """How advantages are computed. `gae` trains a critic; the others use outcome rewards only."""

    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor."""

    lam: float = Field(0.95, ge=0, le=1, alias="lambda")
    """GAE lambda."""

    clip_range_low: float = Field(0.2, gt=0, lt=1)
    """Lower PPO clip range: the ratio is clipped below at 1 - clipRangeLow. Any value in
    (0, 1), including GSPO's small ones (3e-4)."""

    clip_range_high: float = Field(0.2, gt=0, le=10)
    """Upper PPO clip range: the ratio is clipped above at 1 + clipRangeHigh ("clip higher";
    DAPO uses 0.28 with clipRangeLow 0.2, GSPO 4e-4)."""

    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 bounding the loss for negative advantages. Unset disables it."""

    value_clip: float | None = Field(0.2, gt=0)
    """Clip range of the value loss around the old values. Unset disables value clipping."""

    kl: KLSpec = Field(default_factory=KLSpec)
    """KL penalty settings."""

    entropy_coefficient: float = Field(0.0, ge=0)
    """Weight of the entropy bonus in the policy loss."""

    normalize_advantages: bool | None = None
    """Whiten the final advantages over the whole step's response tokens (every data-parallel
    worker's) before the update. Unset: on for `gae`, `reinforce_plus_plus` and
    `reinforce_plus_plus_baseline` (their definitions whiten), off for `grpo` and `rloo` (already
    normalised within each prompt group; whitening again over tokens can flip signs and undoes
    grpoNormByStd: false) and for a customAdvantageFunction. true or false is honoured for every
    estimator; whitening happens once, never twice."""

    grpo_norm_by_std: bool = True
    """For `grpo`: divide by the group's reward standard deviation (false gives Dr. GRPO)."""

    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = (
        "token-mean"
    )
    """How per-token losses are reduced to one number. `token-mean` is DAPO's token-level
    policy-gradient loss (arXiv 2503.14476, section 3.3): every token of the step weighs the
    same, whatever its sample's length. GSPO's objective is `seq-mean-token-mean`."""

    critic_warmup_steps: int = Field(0, ge=0)
    """Steps at the start during which only the critic trains."""

    critic_updates_per_step: int = Field(1, ge=1, le=100)
    """Critic training passes per step."""

    tis_cap: float | None = Field(None, gt=0)
    """Truncated importance sampling: weigh each token's policy loss by min(pi_old / pi_rollout,
    tisCap), where pi_rollout is the engine's sampling log-prob and pi_old the actor's
    recomputed one, to correct for rollout engines whose numerics differ from the trainer's
    (as verl and slime offer; 2 is a common cap). Unset: no correction. Every step reports the
    mismatch as rollout/logprob_diff_mean and rollout/logprob_diff_max either way."""

    routing_replay: Literal["none", "rollout"] = "none"
    """Mixture-of-experts models: `rollout` records, in the rollout engine, the experts every
    token was routed to in every layer, and the actor's forward passes (old and reference
    log-probs, every update) use those experts instead of their routers' own top-k choice
    (the router's weights still come from the actor's router, so it keeps learning). This
    removes the rollout/training mismatch that a different routing decision (another dtype,
    kernel or batch) makes in a MoE model. `none` (the default): each forward routes for
    itself (not `off`, which YAML 1.1, as kubectl reads it, takes for a boolean). With
    `rollout` every step reports moe/router_agreement: the share of token-layer expert choices
    the actor's own routers make exactly as the engine did (what replay overrides where it is
    below 1); either way rollout/logprob_diff_mean and _max show the mismatch left. Needs a
    MoE model (Qwen3-MoE or Mixtral architecture) and single-turn generation; torch actor
    workers replay through their routers, megatron ones through megatron-core's router top-k
    hook. The sglang engine records with its own enable_return_routed_experts."""

    router_aux_loss_coefficient: float = Field(0.0, ge=0, le=1)
    """Mixture-of-experts models: the weight of the router load-balancing loss added to the
    actor's loss (0, the default: none). The loss is the Switch Transformer's
    E * sum_e f_e * P_e per MoE layer (f_e: the share of the tokens' top-k choices that went to
    expert e, by the router's own choice; P_e: e's mean router probability), over each
    micro-batch's real tokens, averaged over the layers, and weighted like the micro-batch's
    policy loss; it is 1 when the routing is uniform and grows as tokens crowd onto few
    experts. The same idea as Hugging Face's router_aux_loss_coef and megatron-core's
    moe_aux_loss_coeff, on another scale: HF's loss is k times this one (pooled over the
    layers) and megatron-core sums its layers' losses, so their coefficient c matches
    c * k here (HF) or c * layers (megatron-core). The torch and megatron actor backends
    compute it alike (with sequence parallelism over the whole sequence); every step reports
    it as actor/router_balance. Needs a MoE model (Qwen3-MoE or Mixtral architecture)."""

    max_staleness: int = Field(0, ge=0, le=16)
    """Bounded staleness: how many policy versions older than the actor a sample's tokens may be
    when it is trained on. 0 (the default) is the synchronous on-policy loop: a step generates,
    then trains. With k > 0 the engines generate the next steps' samples while the actor trains
    (they need engines of their own: roles.rollout.colocateWithActor: false); generation of a
    step is launched only once its samples are sure to be at most k versions old when trained
    on, so none is ever discarded. Every token carries the version that generated it; the step
    reports staleness/mean, staleness/max and time/overlap_share."""

    partial_rollout: bool = False
    """Partial (interruptible) rollout, with maxStaleness > 0: a weight sync reaches the engines
    while they generate, and each loads the new weights between two tokens and samples the rest
    of its in-flight responses from them (re-encoding the tokens so far), instead of finishing
    them with the old ones. A sample's tokens may then come from several policy versions, each
    token tagged with its own, so the off-policy correction stays exact token by token; the
    actor's weights reach the engines through Ray's object store. Torch engines, single-turn
    generation. Reported: rollout/switched_share (the share of samples whose tokens span more
    than one version)."""

    importance_sampling: ImportanceSampling | None = None
    """Off-policy correction (decoupled PPO objective) for stale or mismatched samples: truncated
    (TIS) or masked (MIS) importance weights pi_old / pi_behaviour, per token or per sequence.
    Unset: none. Every step reports is/weight_mean and is/weight_max (before truncation or
    masking) and is/capped_share (the share of tokens truncated or masked)."""

    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """The policy objective. `ppo`: the token-level clipped ratio pi_theta / pi_old. `gspo`:
    Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071): one
    length-normalised ratio per sample, s_i = exp(mean over its tokens of log pi_theta -
    log pi_old), clipped at the sequence level, with the paper's GSPO-token gradient
    s_i,t = sg[s_i] pi_theta(y_t) / sg[pi_theta(y_t)]. GSPO's clip ranges are small (the paper
    uses clipRangeLow 3e-4 and clipRangeHigh 4e-4; both are accepted) and its objective averages
    each sample's tokens, then the samples (lossAggregation seq-mean-token-mean). dualClip does
    not apply to it."""

    dynamic_sampling: DynamicSampling | None = None
    """DAPO's dynamic sampling: filter prompt groups whose rewards are all equal and generate
    more to refill the step. Needs a group estimator (grpo, rloo,
    reinforce_plus_plus_baseline), samplesPerPrompt >= 2 and maxStaleness 0. Unset: off."""

    overlong_shaping: OverlongShaping | None = None
    """DAPO's soft overlong punishment of responses near data.maxResponseLength. Unset: off."""

    mask_truncated_samples: bool = False
    """DAPO's overlong filtering (arXiv 2503.14476, section 3.4): samples cut at
    data.maxResponseLength without a stop token are left out of the policy loss (their tokens
    count neither in the loss nor in its average). A step reports response/truncated_share
    either way."""

    distillation: Distillation | None = None
    """On-policy distillation from a teacher model (reverse KL on the student's samples), alone
    or with the reward. Unset: off."""

    custom_advantage_function: str | None = Field(None, pattern=HOOK_PATTERN)
    """`module:function` computing advantages and returns instead of the estimator; loaded in the
    trainer only. See the trainer guide for its arguments."""

    @property
    def needs_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    @property
    def whitens_advantages(self) -> bool:
        """normalizeAdvantages as set, or its estimator-dependent default when unset."""
        if self.normalize_advantages is not None:
            return self.normalize_advantages
        if self.custom_advantage_function is not None:
            return False
        return self.advantage_estimator in WHITENING_BY_DEFAULT
