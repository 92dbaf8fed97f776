"""Speculative decoding's running totals, for `Engine.stats()["speculative"]`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    verify_steps: int = 0  # steps run as TARGET_VERIFY
    verified_requests: int = 0  # request-steps verified (a step verifies every request in it)
    draft_tokens: int = 0  # drafts proposed (padding excluded)
    accepted_tokens: int = 0  # drafts accepted
    emitted_tokens: int = 0  # tokens verify steps gave requests (accepted drafts + bonus, cut at a finish)
    accept_lengths: dict[int, int] = field(default_factory=dict)  # accepted drafts per request-step -> count

    def record(self, drafts: int, accepted: int) -> None:
        self.verified_requests += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted
        self.accept_lengths[accepted] = self.accept_lengths.get(accepted, 0) + 1

    def as_dict(self) -> dict:
        n = self.verified_requests
        return {
            "verify_steps": self.verify_steps,
            "verified_requests": n,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
            "acceptance_rate": round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else 0.0,
            "mean_accept_length": round((self.accepted_tokens + n) / n, 4) if n else 0.0,
            "accept_length_histogram": dict(sorted(self.accept_lengths.items())),
        }
