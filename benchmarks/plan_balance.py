"""ZeRO plan balance for GPT-2 small (124M): the worst rank's load over the even
share, for each puredist strategy and torch's own assignment (buckets round robin),
over the bucket layout DDP settles on (25 MiB buckets, 1 MiB first bucket).

    python benchmarks/plan_balance.py
"""

from puredist.zero_plan import STRATEGIES, plan_zero, reverse_order_buckets


def gpt2_small_sizes() -> list[int]:
    """GPT-2 small parameter sizes in registration order (tied output embedding)."""
    d, vocab, context, layers = 768, 50257, 1024, 12
    sizes = [vocab * d, context * d]
    for _ in range(layers):
        sizes += [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
    return sizes + [d, d]


def main() -> None:
    sizes = gpt2_small_sizes()
    buckets = reverse_order_buckets([4 * s for s in sizes], 25 * 2**20, 2**20)
    print(f"GPT-2 small: {sum(sizes) / 1e6:.1f}M parameters in {len(sizes)} tensors, {len(buckets)} DDP buckets")
    print(f"worst rank / even share ({', '.join(STRATEGIES[:-1])}; torch = round_robin_buckets)")
    print(f"  {'ranks':>5s} " + " ".join(f"{name:>20s}" for name in STRATEGIES))
    for world_size in (2, 4, 8):
        even = sum(sizes) / world_size
        ratios = [max(plan_zero(sizes, world_size, strategy=s, buckets=buckets).loads(sizes)) / even for s in STRATEGIES]
        print(f"  {world_size:5d} " + " ".join(f"{r:19.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
