#!/usr/bin/env python3
"""Independent computation of the expected values in statistics_test.cpp.

Uses mpmath (50 significant digits) for Student's t and the normal distribution and plain
enumeration for the exact Wilcoxon distribution, so the C++ results (Boost.Math) are checked
against a separate implementation. Run: python3 tests/audit/expected_values.py
"""
from itertools import product
from mpmath import mp, mpf, betainc, sqrt, erfc, findroot

mp.dps = 50

SLEEP_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
DEPRESSION_X = [1.83, 0.50, 1.62, 2.48, 1.68, 1.88, 1.55, 3.06, 1.30]
DEPRESSION_Y = [0.878, 0.647, 0.598, 2.05, 1.06, 1.29, 1.06, 3.14, 1.29]


def t_sf(t, df):
    """P(T > t) for t >= 0."""
    x = df / (df + t * t)
    return betainc(df / 2, mpf(1) / 2, 0, x, regularized=True) / 2


def t_quantile_upper(alpha, df):
    return findroot(lambda q: t_sf(q, df) - alpha, mpf(2))


def mean(v):
    return sum(v) / len(v)


def var(v):
    m = mean(v)
    return sum((x - m) ** 2 for x in v) / (len(v) - 1)


def report(name, diff, se, df):
    t = diff / se
    p = 2 * t_sf(abs(t), df)
    q = t_quantile_upper(mpf('0.025'), df)
    print(f"{name}: diff={mp.nstr(diff, 15)} t={mp.nstr(t, 15)} df={mp.nstr(df, 15)} p={mp.nstr(p, 15)} "
          f"ci=[{mp.nstr(diff - q * se, 15)}, {mp.nstr(diff + q * se, 15)}]")


def welch(a, b):
    a = [mpf(str(x)) for x in a]
    b = [mpf(str(x)) for x in b]
    va, vb = var(a) / len(a), var(b) / len(b)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    report("welch", mean(a) - mean(b), sqrt(va + vb), df)


def student(a, b):
    a = [mpf(str(x)) for x in a]
    b = [mpf(str(x)) for x in b]
    df = mpf(len(a) + len(b) - 2)
    pooled = ((len(a) - 1) * var(a) + (len(b) - 1) * var(b)) / df
    report("student", mean(a) - mean(b), sqrt(pooled * (mpf(1) / len(a) + mpf(1) / len(b))), df)


def paired(a, b):
    d = [mpf(str(x)) - mpf(str(y)) for x, y in zip(a, b)]
    report("paired", mean(d), sqrt(var(d) / len(d)), mpf(len(d) - 1))


def wilcoxon_exact(a, b):
    d = [mpf(str(x)) - mpf(str(y)) for x, y in zip(a, b) if x != y]
    n = len(d)
    order = sorted(range(n), key=lambda i: abs(d[i]))
    ranks = [0] * n
    for r, i in enumerate(order):
        ranks[i] = r + 1
    w_plus = sum(ranks[i] for i in range(n) if d[i] > 0)
    w_minus = sum(ranks[i] for i in range(n) if d[i] < 0)
    stat = min(w_plus, w_minus)
    count = sum(1 for signs in product([0, 1], repeat=n) if sum(r for r, s in zip(range(1, n + 1), signs) if s) <= stat)
    print(f"wilcoxon exact: n={n} statistic={stat} p={mp.nstr(min(1, mpf(2) * count / 2 ** n), 15)}")


def wilcoxon_normal(a, b):
    d = [mpf(str(x)) - mpf(str(y)) for x, y in zip(a, b)]
    d = [x for x in d if x != 0]
    n = len(d)
    absd = sorted(abs(x) for x in d)
    ranks = {}
    tie = 0
    i = 0
    while i < n:
        j = i
        while j < n and absd[j] == absd[i]:
            j += 1
        ranks[absd[i]] = mpf(i + 1 + j) / 2
        g = j - i
        tie += g * (g * g - 1)
        i = j
    w_plus = sum(ranks[abs(x)] for x in d if x > 0)
    w_minus = sum(ranks[abs(x)] for x in d if x < 0)
    stat = min(w_plus, w_minus)
    expected = mpf(n * (n + 1)) / 4
    variance = (mpf(n * (n + 1) * (2 * n + 1)) - mpf(tie) / 2) / 24
    dist = stat - expected
    cc = mpf('0.5') if dist > 0 else (mpf('-0.5') if dist < 0 else 0)
    z = (dist - cc) / sqrt(variance)
    p = erfc(abs(z) / sqrt(2))
    print(f"wilcoxon normal: n={n} statistic={mp.nstr(stat, 15)} z={mp.nstr(z, 15)} p={mp.nstr(p, 15)}")


print("sleep (Student 1908; R's datasets::sleep)")
welch(SLEEP_2, SLEEP_1)
student(SLEEP_2, SLEEP_1)
student(SLEEP_2, SLEEP_1[:4])  # unequal sizes, where pooling differs from Welch
paired(SLEEP_2, SLEEP_1)
wilcoxon_normal(SLEEP_2, SLEEP_1)
print("depression (Hollander & Wolfe 1973, p. 29)")
wilcoxon_exact(DEPRESSION_X, DEPRESSION_Y)
paired(DEPRESSION_X, DEPRESSION_Y)
