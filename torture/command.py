"""`polymq torture`: the command's options and its report."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from polymq.torture.run import Options, run_torture
from polymq.torture.topology import PROTOCOLS
from polymq.torture.worker import Settings


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--duration", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds of publishing, consuming and killing before the drain.")
@click.option("--seed", type=int, default=0, show_default=True, help="The random moments' seed.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The gateway's store, an empty folder (default: a temporary one, removed afterwards).")
@click.option("--kill-min", type=click.FloatRange(min=0.5), default=2.0, show_default=True,
              help="Shortest process life before a SIGKILL (s).")
@click.option("--kill-max", type=click.FloatRange(min=0.5), default=6.0, show_default=True,
              help="Longest process life before a SIGKILL (s).")
@click.option("--kills/--no-kills", default=True, show_default=True, help="SIGKILL and restart the gateway.")
@click.option("--chaos/--no-chaos", default=True, show_default=True,
              help="Random disconnects, consumer crashes and requeues.")
@click.option("--flood", type=click.Choice(PROTOCOLS), default=None,
              help="This protocol's publishers flood: big batches, a deep window, a pause only past 50000"
                   " copies waiting.")
@click.option("--publishers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Publishers per protocol.")
@click.option("--consumers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Consumers per queue.")
@click.option("--emqp-slots", type=click.IntRange(min=1), default=1, show_default=True,
              help="READYs an eMQP worker sends when it joins: its processes (the gateway is told the count).")
@click.option("--drain-timeout", type=click.FloatRange(min=1), default=180.0, show_default=True,
              help="Longest drain (s).")
@click.option("--jetstream", is_flag=True,
              help="Three nats-servers (from the venv) and two gateways sharing queues through them; clients"
                   " spread over both gateways, SIGKILLs fall on gateways and servers alike.")
@click.option("--partitions", is_flag=True,
              help="With --jetstream: every link goes through a proxy of the run's, and the faults include a"
                   " server cut off (held silent, reset at the heal), a server paused and a gateway paused.")
@click.option("--gateway-arg", "gateway_args", multiple=True,
              help="An argument for `polymq serve` (repeat it: --gateway-arg=--fsync --gateway-arg=never).")
def command(duration: float, seed: int, data_dir: Path | None, kill_min: float, kill_max: float, kills: bool,
            chaos: bool, flood: str | None, publishers: int, consumers: int, emqp_slots: int, drain_timeout: float,
            jetstream: bool, partitions: bool, gateway_args: tuple[str, ...]) -> None:
    """Run every protocol's publishers and consumers at once against a gateway this command starts,
    SIGKILLs and restarts on the same store, then drain and count.

    Prints a line per protocol, then `acked=A delivered=D lost=L duplicated=U unexpected=X
    protocols=…` last; exits 1 when something acknowledged was lost, something unexpected came, a
    duplicate was not explained by a crash or a disconnect, or the run itself went wrong.
    """
    if kill_max < kill_min:
        raise click.BadParameter("must not be below --kill-min", param_hint="--kill-max")
    if partitions and not jetstream:
        raise click.BadParameter("needs --jetstream (the links it cuts are the cluster's)", param_hint="--partitions")
    options = Options(
        duration_s=duration, seed=seed, data_dir=data_dir, kill_min_s=kill_min, kill_max_s=kill_max,
        kills=kills, chaos=chaos, drain_timeout_s=drain_timeout, gateway_args=gateway_args, jetstream=jetstream,
        partitions=partitions,
        settings=Settings(publishers=publishers, consumers=consumers, flood=flood, emqp_slots=emqp_slots),
    )
    result = run_torture(options, progress=lambda text: click.echo(f"torture: {text}", err=True))
    report = result.report
    flood_text = f" flood={flood}" if flood else ""
    click.echo(f"torture: duration={duration:g}s seed={seed} kills={report.kills} starts={result.starts}"
               f" drained={'yes' if result.drained else 'no'}{flood_text} elapsed={result.elapsed_s:.1f}s"
               + (f" server_kills={report.server_kills}" if jetstream else "")
               + (f" faults={report.faults}" if partitions else ""))
    for protocol, counts in report.protocols.items():
        click.echo(counts.line(protocol))
    for line in result.rates.lines():
        click.echo(line)
    for problem in (*report.problems, *report.stalls):
        click.echo(f"problem: {problem}")
    for error in report.harness_errors:
        click.echo(f"run error: {error}", err=True)
    click.echo(report.last_line())
    sys.exit(0 if report.ok else 1)
