"""Plain per-sample Python loops: an independent statement of each algorithm, to test the vectorised code against.

Everything here works on nested lists of floats, one sample at a time, straight from the papers' formulas.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict


def rows(tensor):
    return tensor.tolist()


def valid_values(matrix, mask):
    return [v for row, mrow in zip(matrix, mask) for v, m in zip(row, mrow) if m]


def whiten(matrix, mask):
    values = valid_values(matrix, mask)
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in matrix]


def broadcast(per_sample, mask):
    return [[a * m for m in mrow] for a, mrow in zip(per_sample, mask)]


def groups_of(index):
    members = defaultdict(list)
    for i, key in enumerate(index):
        members[key].append(i)
    return members


# ------------------------------------------------------------------ advantage estimators
def gae(rewards, values, mask, gamma, lam):
    advantages, returns = [], []
    for r, v, m in zip(rewards, values, mask):
        T = len(r)
        adv = [0.0] * T
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(T)):
            if m[t]:
                delta = r[t] + gamma * next_value - v[t]
                next_adv = delta + gamma * lam * next_adv
                next_value = v[t]
            adv[t] = next_adv  # a masked step carries the later advantage through
        advantages.append(adv)
        returns.append([a + vv for a, vv in zip(adv, v)])
    return whiten(advantages, mask), returns


def grpo(scores, mask, index, epsilon=1e-6, norm_by_std=True):
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if index[j] == index[i]]
        mean, std = (0.0, 1.0) if len(members) == 1 else (statistics.mean(members), statistics.stdev(members))
        out.append((s - mean) / (std + epsilon) if norm_by_std else s - mean)
    return broadcast(out, mask)


def grpo_passk(scores, mask, index, epsilon=1e-6, norm_by_std=True):
    out = [0.0] * len(scores)
    for members in groups_of(index).values():
        ranked = sorted(members, key=lambda j: -scores[j])
        best, second = ranked[0], ranked[1]
        advantage = scores[best] - scores[second]
        if norm_by_std:
            advantage /= statistics.stdev([scores[j] for j in members]) + epsilon
        out[best] = advantage
    return broadcast(out, mask)


def rloo(scores, mask, index):
    out = []
    for i, s in enumerate(scores):
        others = [scores[j] for j in range(len(scores)) if index[j] == index[i] and j != i]
        out.append(s - sum(others) / len(others) if others else s)
    return broadcast(out, mask)


def opo(scores, mask, index):
    lengths = [sum(m) for m in mask]
    out = []
    for i, s in enumerate(scores):
        members = [j for j in range(len(scores)) if index[j] == index[i]]
        baseline = (
            0.0
            if len(members) == 1
            else sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members)
        )
        out.append(s - baseline)
    return broadcast(out, mask)


def reinforce_plus_plus(rewards, mask, gamma):
    returns = []
    for r, m in zip(rewards, mask):
        g, row = 0.0, [0.0] * len(r)
        for t in reversed(range(len(r))):
            if m[t]:
                g = r[t] + gamma * g
                row[t] = g
        returns.append(row)
    advantages = [[a * mm for a, mm in zip(row, mrow)] for row, mrow in zip(whiten(returns, mask), mask)]
    return advantages, returns


def reinforce_plus_plus_baseline(scores, mask, index):
    centred = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if index[j] == index[i]]
        centred.append(s - (statistics.mean(members) if len(members) > 1 else 0.0))
    matrix = broadcast(centred, mask)
    return [[a * mm for a, mm in zip(row, mrow)] for row, mrow in zip(whiten(matrix, mask), mask)]


def remax(rewards, mask, baselines):
    returns = [[sum(r[k] * m[k] for k in range(t, len(r))) for t in range(len(r))] for r, m in zip(rewards, mask)]
    advantages = [[g - b * mm for g, mm in zip(row, mrow)] for row, mrow, b in zip(returns, mask, baselines)]
    return advantages, returns


def gpg(scores, mask, index, f_norm=1.0):
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if index[j] == index[i]]
        out.append(alpha * (s - (statistics.mean(members) if len(members) > 1 else 0.0)) / f_norm)
    return broadcast(out, mask)


# ------------------------------------------------------------------ aggregation
def agg(loss, mask, mode):
    token_sum = sum(v * m for row, mrow in zip(loss, mask) for v, m in zip(row, mrow))
    if mode == "token-mean":
        return token_sum / sum(sum(m) for m in mask)
    if mode == "token-sum":
        return token_sum
    seq = [(sum(v * m for v, m in zip(row, mrow)), sum(mrow)) for row, mrow in zip(loss, mask) if sum(mrow) > 0]
    if mode == "seq-mean-token-sum":
        return sum(s for s, _ in seq) / len(seq)
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in seq) / len(seq)
    if mode == "seq-mean-token-sum-norm":
        return sum(s for s, _ in seq) / len(seq) / len(mask[0])
    raise ValueError(mode)


def masked_mean(matrix, mask):
    values = valid_values(matrix, mask)
    return sum(values) / len(values)


# ------------------------------------------------------------------ policy losses (per token)
def ppo_clip_token(log_ratio, a, eps_low, eps_high, c):
    r = math.exp(max(-20.0, min(20.0, log_ratio)))
    unclipped, clipped = -a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high)
    loss = max(unclipped, clipped)
    dual_applies = a < 0 and loss > -a * c
    if a < 0:
        loss = min(loss, -a * c)
    return loss, clipped > unclipped, dual_applies


def vanilla(old, new, adv, mask, mode, eps_low, eps_high, c):
    per_token = [
        [ppo_clip_token(n - o, a, eps_low, eps_high, c) for o, n, a in zip(ro, rn, ra)]
        for ro, rn, ra in zip(old, new, adv)
    ]
    loss = agg([[p[0] for p in row] for row in per_token], mask, mode)
    clipfrac = masked_mean([[float(p[1]) for p in row] for row in per_token], mask)
    lower = masked_mean([[float(p[2]) for p in row] for row in per_token], mask)
    kl = masked_mean([[o - n for o, n in zip(ro, rn)] for ro, rn in zip(old, new)], mask)
    return loss, clipfrac, kl, lower


def gspo(old, new, adv, mask, mode, eps_low, eps_high):
    losses, clipped_flags = [], []
    for ro, rn, ra, rm in zip(old, new, adv, mask):
        n_valid = max(sum(rm), 1)
        seq_ratio = math.exp(min(sum((n - o) * m for o, n, m in zip(ro, rn, rm)) / n_valid, 10.0))
        unclipped = [-a * seq_ratio for a in ra]
        clipped = [-a * min(max(seq_ratio, 1 - eps_low), 1 + eps_high) for a in ra]
        losses.append([max(u, c) for u, c in zip(unclipped, clipped)])
        clipped_flags.append([float(c > u) for u, c in zip(unclipped, clipped)])
    return agg(losses, mask, "seq-mean-token-mean"), masked_mean(clipped_flags, mask)  # the paper's objective, any mode


def sapo(old, new, adv, mask, tau_pos, tau_neg):
    losses = []
    for ro, rn, ra in zip(old, new, adv):
        row = []
        for o, n, a in zip(ro, rn, ra):
            tau = tau_pos if a > 0 else tau_neg
            r = math.exp(n - o)
            row.append(-a * (1 / (1 + math.exp(-tau * (r - 1)))) * 4 / tau)
        losses.append(row)
    return agg(losses, mask, "seq-mean-token-mean")


def gpg_loss(new, adv, mask, mode):
    return agg([[-n * a for n, a in zip(rn, ra)] for rn, ra in zip(new, adv)], mask, mode)


def geo_mean(old, new, adv, mask, eps_low, eps_high):
    losses = []
    for ro, rn, ra, rm in zip(old, new, adv, mask):
        n_valid = sum(rm)
        total = 0.0
        for o, n, a, m in zip(ro, rn, ra, rm):
            d = n - o
            clamped = min(max(d, -eps_low), eps_high)
            sign = (a > 0) - (a < 0)
            total += sign * min(sign * d, sign * clamped) * m
        ratio = math.exp(total / (n_valid + 1e-8))
        mean_adv = sum(a * m for a, m in zip(ra, rm)) / (n_valid + 1e-8)
        if n_valid:
            losses.append(-mean_adv * ratio)
    return sum(losses) / len(losses)  # the mean over non-empty sequences


def cispo(old, new, adv, mask, mode, eps_low, eps_high):
    losses = [
        [-min(max(math.exp(n - o), 1 - eps_low), 1 + eps_high) * a * n for o, n, a in zip(ro, rn, ra)]
        for ro, rn, ra in zip(old, new, adv)
    ]
    return agg(losses, mask, mode)


# ------------------------------------------------------------------ KL, value, entropy
def kl_value(lp, ref, name):
    d = lp - ref
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return abs(d)
    if name in ("mse", "k2"):
        return 0.5 * d * d
    x = max(-20.0, min(20.0, -d))
    return max(-10.0, min(10.0, math.exp(x) - x - 1))


def value_loss(vpreds, returns, values, mask, clip, mode):
    losses, flags = [], []
    for rv, rr, rold in zip(vpreds, returns, values):
        row, frow = [], []
        for v, r, o in zip(rv, rr, rold):
            unclipped = (v - r) ** 2
            clipped = (min(max(v, o - clip), o + clip) - r) ** 2
            row.append(max(unclipped, clipped))
            frow.append(float(clipped > unclipped))
        losses.append(row)
        flags.append(frow)
    return 0.5 * agg(losses, mask, mode), masked_mean(flags, mask)


def entropy(logits_row):
    top = max(logits_row)
    exps = [math.exp(z - top) for z in logits_row]
    total = sum(exps)
    return -sum(e / total * math.log(e / total) for e in exps)
