"""The engine's lifecycle controls (`EngineControls`, a base of EngineActor): pause (modes keep,
abort, wait; clear_cache), unpause, flush_cache, suspend, resume, weight updates (from a path, a
state dict, a trainer's weight-transfer group or its CUDA IPC handles) and joining / leaving that
group. Each is checked against the one transition table (messages/lifecycle.py `next_state`; the
coordinator checks it too), runs as a task of its own in arrival order, and is answered with one
ControlAck or ErrorReply, except a pause withdrawn by an unpause before it completed (the
coordinator gave up on it: a timeout, or another rank failed), which the unpause's ack answers
for.

The gpu controls run between steps (`_between_steps`), under expert parallelism on every rank of
the group or on none (`_group_control`: a rank that fails makes the others undo theirs; weights
are staged everywhere and committed only once every rank staged them). An update with
`stage=True` on one rank is staged on its gpu processes and then committed. An update the
coordinator sent with `hold` (several data-parallel ranks) is staged, acknowledged, and swapped
in or dropped only by the coordinator's WeightsDecision, which commits only once every rank
staged it. A transfer that failed part way leaves the weights incomplete (the gpu actor says so
in every reply): unpause is refused until a complete update lands.

Owns: `state`, `weight_version`, `weights_incomplete`, `suspended_mode`, `weights_held` (staged
weights awaiting the coordinator's decision), the pending pause (`pause_waiters`, `pause_mode`,
`pause_clear`) and the scheduler's `admitting` switch. Must not
touch the step protocol (step.py) beyond waiting for it to hand over the channels.
"""

from __future__ import annotations

import dataclasses

from taipan.actors.all_or_none import Failures, two_phase
from taipan.actors.channel import Envelope
from taipan.actors.engine.ep import GroupError
from taipan.actors.engine.flow import EngineError
from taipan.messages.common import ErrorReply
from taipan.messages.errors import ErrorCode
from taipan.messages.gpu import GpuCommand, GpuControl, GpuControlReply
from taipan.messages.lifecycle import (
    CloseWeightTransfer,
    ControlAck,
    ControlCommand,
    FlushCache,
    InitWeightTransfer,
    KVCacheManagementMode,
    LifecycleState,
    Pause,
    PauseMode,
    Resume,
    Suspend,
    Unpause,
    UpdateWeights,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromIpc,
    WeightsDecision,
    next_state,
    next_state_for,
)
from taipan.messages.requests import FinishReason


class EngineControls:
    """The lifecycle half of EngineActor (which provides the channels, `_call`,
    `_between_steps`, `spawn`, `steps`, `ep`, `ep_driver`, `scheduler`, `config` and `rank`)."""

    HANDLERS = {
        Pause: "on_pause",
        Unpause: "on_unpause",
        Suspend: "on_suspend",
        Resume: "on_resume",
        UpdateWeights: "on_update_weights",
        UpdateWeightsFromDistributed: "on_update_from_distributed",
        UpdateWeightsFromIpc: "on_update_from_ipc",
        InitWeightTransfer: "on_init_transfer",
        CloseWeightTransfer: "on_close_transfer",
        FlushCache: "on_flush_cache",
        WeightsDecision: "on_weights_decision",
    }
    weights_held = False  # an update staged with `hold`, awaiting the coordinator's decision
    held_draft = False  # ... of the draft model's weights (UpdateWeights.draft)

    async def _refuse(
        self, env: Envelope, command: ControlCommand, in_flight: bool = False
    ) -> bool:
        """Answer a command this engine's state does not allow (messages/lifecycle.py's
        table, the coordinator's too; `in_flight`: a weight update sent so) and return True;
        False: let it run. An in-flight update under expert parallelism is refused: the group
        steps in lockstep, and one rank held between steps for the update would stall the
        others' collectives."""
        legal = next_state_for(self.state, command, in_flight) is not None
        if legal and self.scheduler is not None and not (in_flight and self.ep is not None):
            return False
        text = f"{self.name}: {command} is illegal while {self.state}"
        if in_flight and self.ep is not None:
            text = (f"{self.name}: in-flight weight updates are not built for expert "
                    "parallelism: pause first")  # fmt: skip
        if self.scheduler is None:
            text = f"{self.name}: {command} before the model is loaded"
        await env.reply(ErrorReply(ErrorCode.ILLEGAL_TRANSITION, text, None))
        return True

    async def _draft_refuses(self, env: Envelope) -> bool:
        """draft_weight_policy "refuse": a weight update is answered with an error naming it
        (a draft model of its own cannot follow the target's new weights); returns True."""
        config = self.config
        if not (config.draft_has_own_weights and config.draft_weight_policy == "refuse"):
            return False
        text = (
            f"{self.name}: update_weights is refused: draft_weight_policy='refuse' and the "
            f"draft model {config.speculative_model!r} cannot follow the target's new weights "
            "(use 'keep' or 'disable', or a 'self:N' draft)"
        )
        await env.reply(ErrorReply(ErrorCode.CONTROL_FAILED, text, None))
        return True

    async def _ack(self, env: Envelope, command: ControlCommand) -> None:
        await env.reply(ControlAck(command, self.state, self.weight_version))

    def _control_task(self, coro) -> None:
        """Run a control after the ones before it, off the receive loop."""

        async def in_order():
            async with self.control_lock:
                await coro

        self.spawn(in_order())

    async def on_pause(self, env: Envelope, msg: Pause) -> None:
        """A pause is pending (`pause_waiters`) until it completes. Keep and abort: no new step
        starts now, the ack comes once the steps in flight end. Wait: admission stops now
        (submissions queue), and the pause completes once every request that started has
        ended (`draining_done`). Under expert parallelism the group pauses together: the step
        loop votes `pause_ready` and the ack comes once every rank paused (ep.py)."""
        if await self._refuse(env, ControlCommand.PAUSE):
            return
        if self.pause_waiters:
            text = f"{self.name}: a pause is already pending here"
            await env.reply(ErrorReply(ErrorCode.ILLEGAL_TRANSITION, text, None))
            return
        self.pause_mode, self.pause_clear = msg.mode, msg.clear_cache
        self.pause_waiters.append(env)
        if msg.mode == PauseMode.WAIT:
            self.scheduler.admitting = False
        self.work.set()
        if self.ep_driver is not None:
            return
        if msg.mode == PauseMode.WAIT:
            self.spawn(self._pause_when_drained(env))
            return
        self.state = next_state(self.state, ControlCommand.PAUSE)  # no new step starts now
        self._control_task(self._pause_after_step(env))

    def pause_ready(self) -> bool:
        """A pause is pending and this rank may stop now (mode wait: once drained)."""
        if not self.pause_waiters:
            return False
        return self.pause_mode != PauseMode.WAIT or self.scheduler.drained()

    def draining_done(self) -> bool:
        """A pause in mode wait is pending and every request that started has ended: plan no
        more steps (the pause completes next; the frees wait for the unpause or a flush)."""
        return self.pause_mode == PauseMode.WAIT and self.pause_ready()

    async def _pause_when_drained(self, env: Envelope) -> None:
        """Mode wait, one rank: wait for the drain (the step loop sets `drain_progress` after
        every run of steps and every abort), then pause. No bound here: the coordinator's
        timeout withdraws the pause with an Unpause (`on_unpause`)."""
        while env in self.pause_waiters and not self.scheduler.drained():
            self.drain_progress.clear()
            await self.drain_progress.wait()
        if env in self.pause_waiters:
            self.state = next_state(self.state, ControlCommand.PAUSE)
            self._control_task(self._pause_after_step(env))

    async def _pause_after_step(self, env: Envelope) -> None:
        async with self._between_steps():  # the steps in flight end before the ack
            if env not in self.pause_waiters:
                return  # withdrawn by an unpause meanwhile (which answered)
            self.pause_waiters.remove(env)
            await self.paused_now()
            await self._ack(env, ControlCommand.PAUSE)

    async def paused_now(self) -> None:
        """The rank has stopped stepping (no step in flight; the caller holds the channels):
        apply the pause's mode. ABORT ends every request it holds (each with its tokens so far
        and finish_reason "abort"; its blocks are freed with the next plan). Then, with
        `clear_cache`, the cached prefix goes (`_flush`)."""
        if self.pause_mode == PauseMode.ABORT:
            await self.steps.emit(self.scheduler.fail_all(FinishReason.ABORT, self.now))
        if self.pause_clear:
            await self._flush()

    async def _flush(self) -> None:
        """Drop every cached prefix block and Mamba snapshot no request holds: one step that
        runs no forward tells the allocator (scheduler.py `flush_cache`); the evicted hashes go
        to the coordinator's routing table with it. No step may be in flight."""
        batch = self.scheduler.flush_cache()
        if batch is not None:
            await self.steps.dispatch(batch)

    async def on_flush_cache(self, env: Envelope, msg: FlushCache) -> None:
        if await self._refuse(env, ControlCommand.FLUSH_CACHE):
            return
        self._control_task(self._flush_between_steps(env))

    async def _flush_between_steps(self, env: Envelope) -> None:
        async with self._between_steps():
            await self._flush()
        await self._ack(env, ControlCommand.FLUSH_CACHE)

    def _withdraw_pause(self) -> None:
        """An unpause came while a pause is still pending (the coordinator gave up on it: a
        timeout, or another rank failed): forget it without an answer (the unpause's ack
        answers for it) and admit again."""
        if self.pause_waiters:
            self.log.info("pause withdrawn by unpause", mode=str(self.pause_mode))
        self.pause_waiters.clear()
        self.scheduler.admitting = True
        self.drain_progress.set()
        self.work.set()

    async def on_unpause(self, env: Envelope, msg: Unpause) -> None:
        if self.pause_waiters and self.state is LifecycleState.RUNNING:
            self._withdraw_pause()  # (mode wait draining, or a group not yet paused)
            await self._ack(env, ControlCommand.UNPAUSE)
            return
        if await self._refuse(env, ControlCommand.UNPAUSE):
            return
        if self.weights_incomplete:
            text = (
                f"{self.name}: unpause refused: a weight transfer failed part way and the "
                "weights are incomplete; complete an update first"
            )
            await env.reply(ErrorReply(ErrorCode.CONTROL_FAILED, text, None))
            return
        self.state = next_state(self.state, ControlCommand.UNPAUSE)
        self._withdraw_pause()  # (a keep or abort pause whose ack is still to come)
        await self._ack(env, ControlCommand.UNPAUSE)

    async def _gpu_control(
        self, env: Envelope, command: ControlCommand, msg: GpuControl, hold: bool = False
    ):
        """Run one gpu control call between steps (under expert parallelism, on every rank of
        the group or on none: `_group_control`; `hold`: a weight update is left staged there);
        an error goes back to the coordinator."""
        async with self._between_steps():
            if self.ep is None:
                reply = await self._gpu_call(msg)
            else:
                reply = await self._group_control(command, msg, hold)
        if reply.error is not None:
            await env.reply(ErrorReply(ErrorCode.CONTROL_FAILED, f"{command}: {reply.error}", None))
            return None
        return reply

    async def _gpu_call(self, msg: GpuControl) -> GpuControlReply:
        """One call to the gpu actor (a failure comes back as the reply's error). A resume that
        reports the KV contents gone makes every request recompute, whatever follows."""
        try:
            reply = await self._call(self.gpu, msg, GpuControlReply)
        except EngineError as e:
            return GpuControlReply(
                msg.command, str(e), True, self.weight_version, self.weights_incomplete
            )
        self.weights_incomplete = reply.weights_incomplete
        if reply.error is None and reply.command == GpuCommand.RESUME and not reply.kv_valid:
            self.scheduler.invalidate_kv()
        return reply

    async def _group_control(
        self, command: ControlCommand, msg: GpuControl, hold: bool = False
    ) -> GpuControlReply:
        """All or none over the expert-parallel group (actors/all_or_none.py): apply the control
        here (a weight update only staged), tell the peers how it went (an EpOutcome round),
        then keep it (commit the weights, unless `hold` leaves that to the coordinator) if every
        rank succeeded, else undo it here. The error of a failed round names the ranks that
        failed."""
        first = msg
        if command is ControlCommand.UPDATE_WEIGHTS:
            first = dataclasses.replace(msg, command=GpuCommand.STAGE_WEIGHTS)
        reply = await self._gpu_call(first)

        async def stage() -> Failures:
            try:
                return Failures.of(await self.ep.outcome(command, reply.error))
            except GroupError as e:
                await self.steps.die(str(e))  # (never returns)

        async def keep() -> None:
            nonlocal reply
            if command is ControlCommand.UPDATE_WEIGHTS and not hold:
                reply = await self._gpu_call(
                    GpuControl(GpuCommand.COMMIT_WEIGHTS, None, None, None)
                )
                if reply.error is not None:  # the peers have committed: no way back
                    await self.steps.die(f"committing staged weights failed: {reply.error}")

        async def undo(failed: Failures) -> None:
            nonlocal reply
            back = self._undo(command) if reply.error is None else None
            if back is not None:
                undone = await self._gpu_call(back)
                if undone.error is not None:
                    await self.steps.die(f"{command} failed on a peer and could not be undone "
                                         f"here: {undone.error}")  # fmt: skip
            if self.rank not in failed.why:
                text = (
                    "undone here, expert-parallel peers failed ("
                    + failed.describe(lambda r: f"engine {r}")
                    + ")"
                )
                reply = GpuControlReply(
                    msg.command, text, reply.kv_valid, self.weight_version, self.weights_incomplete
                )

        await two_phase(stage, keep, undo)
        return reply

    def _undo(self, command: ControlCommand) -> GpuControl | None:
        if command is ControlCommand.SUSPEND:
            return GpuControl(GpuCommand.RESUME, None, None, None)
        if command is ControlCommand.RESUME:
            return GpuControl(GpuCommand.SUSPEND, self.suspended_mode, None, None)
        if command is ControlCommand.INIT_WEIGHT_TRANSFER:
            return GpuControl(GpuCommand.CLOSE_WEIGHT_TRANSFER, None, None, None)
        if command is ControlCommand.CLOSE_WEIGHT_TRANSFER:
            return None  # a group left cannot be joined again alone (the trainer is gone)
        return GpuControl(GpuCommand.DISCARD_WEIGHTS, None, None, None)

    async def on_suspend(self, env: Envelope, msg: Suspend) -> None:
        if await self._refuse(env, ControlCommand.SUSPEND):
            return
        mode = msg.mode or self.config.kv_cache_management_mode or KVCacheManagementMode.PERSIST
        self._control_task(self._suspend(env, GpuControl(GpuCommand.SUSPEND, mode, None, None)))

    async def _suspend(self, env: Envelope, control: GpuControl) -> None:
        if await self._gpu_control(env, ControlCommand.SUSPEND, control):
            self.state = next_state(self.state, ControlCommand.SUSPEND)
            self.suspended_mode = control.mode
            await self._ack(env, ControlCommand.SUSPEND)

    async def on_resume(self, env: Envelope, msg: Resume) -> None:
        if await self._refuse(env, ControlCommand.RESUME):
            return
        self._control_task(self._resume(env))

    async def _resume(self, env: Envelope) -> None:
        control = GpuControl(GpuCommand.RESUME, None, None, None)
        reply = await self._gpu_control(env, ControlCommand.RESUME, control)
        if reply is not None:  # (a resume that dropped the KV invalidated it: _gpu_call)
            self.state = next_state(self.state, ControlCommand.RESUME)
            await self._ack(env, ControlCommand.RESUME)

    async def on_update_weights(self, env: Envelope, msg: UpdateWeights) -> None:
        if await self._update_refused(env, msg):
            return
        command = GpuCommand.STAGE_WEIGHTS if msg.hold else GpuCommand.UPDATE_WEIGHTS
        control = GpuControl(
            command, None, msg.path, msg.state, weight_version=msg.weight_version, draft=msg.draft
        )
        self._control_task(self._update_weights(env, control, msg.hold))

    async def _update_refused(
        self,
        env: Envelope,
        msg: UpdateWeights | UpdateWeightsFromDistributed | UpdateWeightsFromIpc,
    ) -> bool:
        """A weight update this state, or the draft's settings, refuse (the reply sent);
        returns True."""
        if await self._refuse(env, ControlCommand.UPDATE_WEIGHTS, msg.in_flight):
            return True
        if msg.draft:  # (the draft's own weights: no policy applies)
            return await self._no_draft_of_its_own(env)
        return await self._draft_refuses(env)

    async def _no_draft_of_its_own(self, env: Envelope) -> bool:
        """An update of the draft's weights needs a draft model with weights of its own: else
        the reply is an error naming why; returns True."""
        config = self.config
        if config.draft_has_own_weights:
            return False
        text = (
            f"{self.name}: update_weights(draft=True) needs a draft model with weights of its "
            f"own (speculative_method='draft_model' and a speculative_model path or name); "
            f"this runtime has speculative_method={config.speculative_method!r}, "
            f"speculative_model={config.speculative_model!r}, num_speculative_tokens="
            f"{config.num_speculative_tokens} (a 'self:N' draft follows the target's weights)"
        )
        await env.reply(ErrorReply(ErrorCode.BAD_REQUEST, text, None))
        return True

    async def on_update_from_distributed(
        self, env: Envelope, msg: UpdateWeightsFromDistributed
    ) -> None:
        """The trainer's buckets into every gpu process of this rank; with `stage`, staged on
        all of them first and committed only once every one holds all of its weights."""
        if await self._update_refused(env, msg):
            return
        control = GpuControl(
            GpuCommand.STAGE_WEIGHTS if msg.stage else GpuCommand.UPDATE_WEIGHTS,
            None,
            None,
            None,
            weight_version=msg.weight_version,
            buckets=msg.buckets,
            draft=msg.draft,
        )
        self._control_task(self._update_weights(env, control, msg.hold and msg.stage))

    async def on_update_from_ipc(self, env: Envelope, msg: UpdateWeightsFromIpc) -> None:
        """The trainer's CUDA tensors, by IPC handle, into every gpu process of this rank (each
        opens and maps all of them before any copies; `stage`: committed as a second call)."""
        if await self._update_refused(env, msg):
            return
        command = GpuCommand.STAGE_WEIGHTS if msg.stage else GpuCommand.UPDATE_WEIGHTS
        control = GpuControl(
            command,
            None,
            None,
            None,
            weight_version=msg.weight_version,
            ipc=msg.tensors,
            draft=msg.draft,
        )
        self._control_task(self._update_weights(env, control, msg.hold and msg.stage))

    async def on_init_transfer(self, env: Envelope, msg: InitWeightTransfer) -> None:
        """Join the trainer's weight-transfer group: this rank's gpu processes take ranks
        rank_offset + rank * tp_size + tp rank (the gpu actor adds its tp rank)."""
        if await self._refuse(env, ControlCommand.INIT_WEIGHT_TRANSFER):
            return
        group = msg.group
        base = group.rank_offset + self.rank * self.tp_size
        if group.world_size < base + self.tp_size:
            text = (
                f"{self.name}: init_weight_transfer: world_size {group.world_size} has no room "
                f"for this rank's processes (ranks {base}..)"
            )
            await env.reply(ErrorReply(ErrorCode.BAD_REQUEST, text, None))
            return
        mine = dataclasses.replace(group, rank_offset=base)
        control = GpuControl(GpuCommand.INIT_WEIGHT_TRANSFER, None, None, None, transfer=mine)
        self._control_task(
            self._transfer_control(env, ControlCommand.INIT_WEIGHT_TRANSFER, control)
        )

    async def on_close_transfer(self, env: Envelope, msg: CloseWeightTransfer) -> None:
        if await self._refuse(env, ControlCommand.CLOSE_WEIGHT_TRANSFER):
            return
        control = GpuControl(GpuCommand.CLOSE_WEIGHT_TRANSFER, None, None, None)
        self._control_task(
            self._transfer_control(env, ControlCommand.CLOSE_WEIGHT_TRANSFER, control)
        )

    async def _transfer_control(
        self, env: Envelope, command: ControlCommand, control: GpuControl
    ) -> None:
        if await self._gpu_control(env, command, control):
            await self._ack(env, command)

    async def _update_weights(self, env: Envelope, control: GpuControl, hold: bool) -> None:
        """Stage or load the weights; `hold`: stage them and leave the swap to the coordinator's
        WeightsDecision (the ack then carries the old weight version)."""
        reply = await self._gpu_control(env, ControlCommand.UPDATE_WEIGHTS, control, hold)
        if reply is not None and hold:
            self.weights_held, self.held_draft = True, control.draft
            await self._ack(env, ControlCommand.UPDATE_WEIGHTS)
            return
        if reply is not None and control.command == GpuCommand.STAGE_WEIGHTS and self.ep is None:
            # stage=True on one rank: every gpu process holds all of it now; swap them in (an
            # expert-parallel group's `_group_control` has committed already).
            commit = GpuControl(GpuCommand.COMMIT_WEIGHTS, None, None, None)
            reply = await self._gpu_control(env, ControlCommand.UPDATE_WEIGHTS, commit)
        if reply is not None:
            self._weights_landed(reply.weight_version, control.draft)
            await self._ack(env, ControlCommand.UPDATE_WEIGHTS)

    def _weights_landed(self, weight_version: int, draft: bool) -> None:
        """New weights are in: the target's (a new version: the scheduler ages its requests
        and salts its hashes anew) or the draft's (speculation may resume; nothing else)."""
        if draft:
            self.scheduler.draft_updated()
            return
        self.weight_version = weight_version
        self.scheduler.new_weights(weight_version)

    async def on_weights_decision(self, env: Envelope, msg: WeightsDecision) -> None:
        """The coordinator's verdict on weights staged with `hold`: commit them (every rank
        staged them) or drop them. Runs after the staging it answers (controls run in arrival
        order), so a decision that overtook a slow staging still finds it."""
        # (While RUNNING it answers an update sent in flight: legal, and `_decide_weights` checks
        # that weights are staged here.)
        running = self.state == LifecycleState.RUNNING
        if not running and await self._refuse(env, ControlCommand.UPDATE_WEIGHTS):
            return
        self._control_task(self._decide_weights(env, msg.commit))

    async def _decide_weights(self, env: Envelope, commit: bool) -> None:
        if not self.weights_held:
            text = f"{self.name}: {'commit' if commit else 'discard'}: no weights are staged here"
            await env.reply(ErrorReply(ErrorCode.CONTROL_FAILED, text, None))
            return
        self.weights_held = False
        command = GpuCommand.COMMIT_WEIGHTS if commit else GpuCommand.DISCARD_WEIGHTS
        async with self._between_steps():
            reply = await self._gpu_call(GpuControl(command, None, None, None))
        if reply.error is not None:
            text = f"{self.name}: update_weights: {reply.error}"
            await env.reply(ErrorReply(ErrorCode.CONTROL_FAILED, text, None))
            return
        if commit:
            self._weights_landed(reply.weight_version, self.held_draft)
        await self._ack(env, ControlCommand.UPDATE_WEIGHTS)
