"""Two hosts, simulated (issue 40 item 4): SmolLM2 split across two ggml-rpc-servers, each on its own host behind a
link of a given bandwidth and latency; our decode and prompt tok/s beside llama-bench's with the same split through
the same links, in one run, so the cost of a real multi-host deployment is known before anyone builds one.

The hosts are network namespaces joined to this one (the client's) by veth pairs (root and `ip` needed; else
127.0.0.1, and the reason is printed). The links are kvflash_ggml.testing.link's forwarder, which stands in for
`tc netem` (this VM's kernel has no netem; the GPU machines have no `tc`): latency and rate both come from it.
--links both (the default): the client is a third machine, both servers behind a link (each step crosses the link
to both); --links b: the client sits on host A (its server local), only host B behind the link (a two-machine
deployment's cost). Each profile runs, --rounds times in turns, llama-bench (--rpc A,B -dev RPC0/RPC1 -sm layer
-ts 1/1 -ngl 99 -fa 1) and `kvflash bench decode` / `kvflash bench prefill` with --devices rpc:A,rpc:B
--tensor-split 1,1 (our pooled session); the table has the medians over the rounds (this 2-core VM is shared, and
one round's ratio moved by 20% when another process ran), and each round's ratio. Then each server's round trips and
bytes per decode token through counting links, ours and llama-bench's: what a link's latency multiplies. Measured
(this VM): llama-bench 1 round trip per server per token (and B sends the whole logits row, 192 KiB); ours 1 too
(B: 8 KiB, the greedy token's row maxima and argmaxes). Ours were 2 before each layer's input readers were pinned to
its device (graph.h: pin_layer_boundaries) and the greedy read became one tensor.

    OMP_WAIT_POLICY=passive python experiments/two_hosts.py --profiles none,dc,home
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from kvflash_ggml.bench.reference import llama_bench_results, llama_bench_split, locate_llama_bench, median_ts
from kvflash_ggml.known_models import resolve_model_path
from kvflash_ggml.rpc import find_rpc_server
from kvflash_ggml.testing.link import PROFILES, Hosts, Link, LinkProfile, link_rtt, start_rpc_server_on

# A one-connection-at-a-time echo server for the RTT measurement, run on the far host.
ECHO = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
while True:
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (d := c.recv(65536)):
        c.sendall(d)
    c.close()
"""


def start_echo(host):
    proc = subprocess.Popen(host.run_argv([sys.executable, "-c", ECHO, host.address]), stdout=subprocess.PIPE,
                            text=True)
    return proc, f"{host.address}:{int(proc.stdout.readline())}"


def ours(command, endpoints, args, out_json):
    """One `kvflash bench` command (ours only, the pool of --pool) on the split through `endpoints`: {depth or
    length: tok/s}."""
    argv = [sys.executable, "-m", "kvflash_ggml", "bench", command, "--model", args.model, "--no-llama-bench",
            "--devices", ",".join(f"rpc:{e}" for e in endpoints), "--tensor-split", "1,1",
            "--threads", str(args.threads), "--kvflash", str(args.pool), "--json", str(out_json)]
    if command == "decode":   # the pool only: our full cache is the same session below the pool's size
        argv += ["--depths", args.depths, "--n-gen", str(args.n_gen), "--reps", str(args.reps), "--plot", "",
                 "--full-up-to=-1"]
    else:
        argv += ["--lengths", str(args.prompt), "--modes", "pooled", "--reps", str(args.prompt_reps)]
    print("$ " + " ".join(argv[1:]), file=sys.stderr, flush=True)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads(Path(out_json).read_text())["rows"]
    return {r.get("depth", r.get("length")): r["pooled"]["tok_s"] for r in rows}


def llama_split(endpoints):
    """llama-bench's flags for our split (kvflash bench's own: --rpc A,B -dev RPC0/RPC1 -sm layer -ts 1/1)."""
    return llama_bench_split(argparse.Namespace(devices=[f"rpc:{e}" for e in endpoints],
                                                tensor_split=[1.0] * len(endpoints)))


def llama(binary, endpoints, args):
    """llama-bench on the same split through the same links: {depth: decode tok/s}, {length: prompt tok/s}."""
    split = llama_split(endpoints)
    path = resolve_model_path(args.model)
    decode = llama_bench_results(binary, path, ["-p", "0", "-n", str(args.n_gen), "-d", args.depths, *split],
                                 args.threads, True, args.reps)
    prompt = llama_bench_results(binary, path, ["-p", str(args.prompt), "-n", "0", *split], args.threads, True,
                                 args.prompt_reps)
    return {int(r["n_depth"]): median_ts(r) for r in decode}, {int(r["n_prompt"]): median_ts(r) for r in prompt}


def one_round(i, name, endpoints, binary, args, out_dir):
    """Ours and llama-bench once each, in turns (llama-bench first in even rounds), as {(what, key): tok/s}."""
    def run_ours():
        return ours("decode", endpoints, args, out_dir / f"decode-{name}-{i}.json"), \
            ours("prefill", endpoints, args, out_dir / f"prefill-{name}-{i}.json")
    if i % 2 == 0:
        (llama_decode, llama_prompt), (decode, prompt) = llama(binary, endpoints, args), run_ours()
    else:
        (decode, prompt), (llama_decode, llama_prompt) = run_ours(), llama(binary, endpoints, args)
    out = {("ours", d): v for d, v in decode.items()} | {("llama", d): v for d, v in llama_decode.items()}
    out |= {("ours_prompt", n): v for n, v in prompt.items()}
    return out | {("llama_prompt", n): v for n, v in llama_prompt.items()}


def traffic_per_token(servers, binary, args):
    """Each server's link traffic per decode token, ours and llama-bench's: the difference between a run of 48 and
    one of 16 greedy tokens at depth 0 (loading, warm-up and prompt cancel), through unpaced links with no latency
    that only count. {(who, server index): {"exchanges", "bytes_up", "bytes_down"} per token}."""
    path, n_lo, n_hi = resolve_model_path(args.model), 16, 48
    out = {}
    for who in ("ours", "llama"):
        totals = []
        for n_gen in (n_lo, n_hi):
            links = [Link(ep, LinkProfile("count", 0.0, 0.0)) for _, ep in servers]
            try:
                endpoints = [link.endpoint for link in links]
                if who == "llama":
                    llama_bench_results(binary, path, ["-p", "0", "-n", str(n_gen), "-d", "0", *llama_split(endpoints)],
                                        args.threads, True, 1)
                else:
                    subprocess.run([sys.executable, "-m", "kvflash_ggml", "bench", "decode", "--model", args.model,
                                    "--no-llama-bench", "--devices", ",".join(f"rpc:{e}" for e in endpoints),
                                    "--tensor-split", "1,1", "--threads", str(args.threads),
                                    "--kvflash", str(args.pool),
                                    "--depths", "0", "--n-gen", str(n_gen), "--reps", "1", "--full-up-to=-1",
                                    "--json", "", "--plot", ""], check=True, stdout=subprocess.DEVNULL)
                totals.append([link.stats() for link in links])
            finally:
                for link in links:
                    link.close()
        for i, (lo, hi) in enumerate(zip(*totals)):
            out[who, i] = {k: (hi[k] - lo[k]) / (n_hi - n_lo) for k in ("exchanges", "bytes_up", "bytes_down")}
    return out


def print_traffic(traffic):
    print("per decode token, each server's link (48 tokens less 16): " + "; ".join(
        f"{who} {'AB'[i]}: {t['exchanges']:.1f} round trips, {t['bytes_up'] / 1024:.1f} KiB up, "
        f"{t['bytes_down'] / 1024:.1f} KiB down" for (who, i), t in sorted(traffic.items())))


def run_profile(name, hosts, servers, binary, args, out_dir):
    """Links at profile `name` (none: direct), the RTT through them, and --rounds rounds of both benches; the
    table's rows (medians over the rounds, and each round's ratio)."""
    profile = PROFILES.get(name)
    behind = [profile is not None and (args.links == "both" or i == 1) for i in range(len(servers))]
    links = [Link(ep, profile) if b else None for (_, ep), b in zip(servers, behind)]
    echo, echo_link = start_echo(hosts.hosts[1]), None
    try:
        echo_link = Link(echo[1], profile) if profile else None
        rtt = link_rtt(echo_link.endpoint if echo_link else echo[1])
        endpoints = [link.endpoint if link else ep for link, (_, ep) in zip(links, servers)]
        rounds = [one_round(i, name, endpoints, binary, args, out_dir) for i in range(args.rounds)]
    finally:
        for link in [*links, echo_link]:
            if link:
                link.close()
        echo[0].kill()
        echo[0].wait()
    med = lambda key: statistics.median(r[key] for r in rounds)
    return [{"profile": name, "rtt_ms": rtt * 1e3, "depth": d, "ours": med(("ours", d)), "llama": med(("llama", d)),
             "ratios": [r[("ours", d)] / r[("llama", d)] for r in rounds],
             "prompt": med(("ours_prompt", args.prompt)), "prompt_llama": med(("llama_prompt", args.prompt)),
             "prompt_ratios": [r[("ours_prompt", args.prompt)] / r[("llama_prompt", args.prompt)] for r in rounds]}
            for d in map(int, args.depths.split(","))]


def print_table(rows, args, reason):
    spread = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}"
    print(f"SmolLM2 split 1:1 over two ggml-rpc-servers ({reason}); links: {args.links}; client threads "
          f"{args.threads}, server threads {args.server_threads}; ours: pool {args.pool}; decode: median of "
          f"{args.reps} windows of {args.n_gen}; prompt: {args.prompt} tokens, median of {args.prompt_reps}; "
          f"figures: median over {args.rounds} rounds (ours and llama-bench in turns)")
    print(f"{'profile':>8} {'RTT ms':>7} {'depth':>6} {'ours':>7} {'llama':>7} {'ratio':>6} {'rounds':>10} "
          f"{'prompt':>8} {'llama':>8} {'ratio':>6} {'rounds':>10}")
    for r in rows:
        print(f"{r['profile']:>8} {r['rtt_ms']:>7.2f} {r['depth']:>6} {r['ours']:>7.1f} {r['llama']:>7.1f} "
              f"{r['ours'] / r['llama']:>6.2f} {spread(r['ratios']):>10} {r['prompt']:>8.1f} {r['prompt_llama']:>8.1f} "
              f"{r['prompt'] / r['prompt_llama']:>6.2f} {spread(r['prompt_ratios']):>10}")
    print("tok/s; ratio: ours / llama-bench, of the medians; rounds: the lowest and highest ratio of one round; RTT: "
          "64-byte round trips through the link to the far host (the emulator's own cost included); llama: "
          "llama-bench -dev RPC0/RPC1 -sm layer -ts 1/1 -fa 1 -ngl 99")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="none,dc,home", help=f"comma-separated of none,{','.join(PROFILES)}")
    ap.add_argument("--links", choices=("both", "b"), default="both", help="which servers sit behind a link")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=1, help="the client's CPU threads (it computes nothing here)")
    ap.add_argument("--server-threads", type=int, default=1, help="each ggml-rpc-server's threads")
    ap.add_argument("--depths", default="0,512")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5, help="decode windows per measurement (llama-bench -r)")
    ap.add_argument("--prompt-reps", type=int, default=3, help="prompts per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="ours and llama-bench in turns this many times; medians")
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=512, help="prompt length of the prefill figure")
    ap.add_argument("--llama-bench", default=None, help="path to llama-bench (default: search, as kvflash bench does)")
    ap.add_argument("--no-traffic", dest="traffic", action="store_false",
                    help="skip counting each server's round trips and bytes per decode token")
    ap.add_argument("--no-netns", action="store_true", help="127.0.0.1 even where namespaces can be made")
    ap.add_argument("--out", default="bench-out/two_hosts", help="where each bench's JSON goes")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # so that the servers, links and namespaces go too
    names = [p for p in args.profiles.split(",") if p]
    if not set(names) <= {"none", *PROFILES}:
        ap.error(f"--profiles: of none,{','.join(PROFILES)}")
    binary = find_rpc_server()
    if binary is None:
        sys.exit("ggml-rpc-server not found (pip install . builds it; or $KVFLASH_RPC_SERVER)")
    found = locate_llama_bench(args.llama_bench)
    if found is None:
        sys.exit("llama-bench not found: build it with scripts/build_llama_bench.sh, or pass --llama-bench PATH")
    llama_binary = found[0]
    if os.environ.get("OMP_WAIT_POLICY") != "passive":
        print("note: OMP_WAIT_POLICY is not passive: on a shared 2-core VM the figures may be 30-100x off",
              file=sys.stderr)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with Hosts(2, use_netns=not args.no_netns) as hosts:
        reason = ("hosts: network namespaces joined to the client's by veth pairs" if hosts.reason is None
                  else f"hosts: 127.0.0.1 ({hosts.reason})")
        print(reason, file=sys.stderr)
        servers = [start_rpc_server_on(h, binary, threads=args.server_threads) for h in hosts.hosts]
        try:
            traffic = traffic_per_token(servers, llama_binary, args) if args.traffic else {}
            rows = [r for name in names for r in run_profile(name, hosts, servers, llama_binary, args, out_dir)]
        finally:
            for proc, _ in servers:
                proc.kill()
                proc.wait()
    print_table(rows, args, reason)
    if traffic:
        print_traffic(traffic)
    (out_dir / "two_hosts.json").write_text(json.dumps({"args": vars(args), "hosts": reason, "rows": rows, "traffic": [
        {"who": who, "server": i, **t} for (who, i), t in sorted(traffic.items())]}, indent=2))


if __name__ == "__main__":
    main()
