"""Tripwire: every private hivemind internal p2p_diloco relies on, named in one place.

The swarm layer subclasses hivemind's averager, all-reduce runner and signature validator, overrides some of
their private methods and reads some private fields (``p2p_diloco/swarm/*``, ``swarm/hivemind_codecs.py``,
``cli/doctor.py``). A hivemind release that renames or reshapes any of them must fail HERE, with the name,
not deep inside a swarm round. Supported: hivemind >= 1.1.10, < 1.2 (pyproject.toml; README).

When a test below fails after a hivemind upgrade, read the new hivemind code for that name, adapt the module
that uses it, and update this table. Adding a new dependency on a hivemind private internal means adding it
here.
"""

from __future__ import annotations

import inspect
import re

import hivemind
import pytest
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture
from packaging.version import Version

# (class, name, where p2p_diloco uses it). Methods: overridden or called. Fields: read or written.
METHODS = [
    (DecentralizedAverager, "_shutdown", "swarm/averager.py overrides it (finalizes our runners, swarm/registry.py)"),
    (DecentralizedAverager, "_run_internal", "swarm/averager.py's run() makes the AveragerProcess before it"),
    (DecentralizedAverager, "_get_current_state_from_host_process",
     "swarm/averager.py hands it to chunk_transfer.ChunkServer (the state to serve, from the training process)"),
    (Matchmaking, "_request_join_group", "swarm/access.py wraps it (refuses leaders not allowed)"),
    (Matchmaking, "_check_reasons_to_reject", "swarm/patience.py and swarm/quorum.py wrap it"),
    (PotentialLeaders, "_declare_averager_periodically", "swarm/patience.py wraps it"),
    (Matchmaking, "leader_assemble_group", "swarm/round_process.py hooks it for the stall_leader fault; swarm/quorum.py calls it"),
    (AllReduceRunner, "_communicate_with_peer", "swarm/runner.py overrides it"),
    (AllReduceRunner, "_accumulate_parts_streaming", "swarm/runner.py overrides it (checks parts at receipt)"),
    (AllReduceRunner, "_get_peer_stub", "swarm/runner.py overrides it"),
    (AllReduceRunner, "_generate_input_for_peer", "swarm/runner.py overrides it"),
    (AllReduceRunner, "_ban_sender", "swarm/runner.py calls it"),
    (RSASignatureValidator, "_serialize_record", "swarm/signing.py calls it"),
    (P2P, "_make_process_args", "swarm/relay.py wraps it (adds -relayDiscovery=0 for static relays)"),
]
FIELDS = [
    (DecentralizedAverager, "_outer_pipe", "swarm/commands.py sends our commands through it"),
    (DecentralizedAverager, "_inner_pipe", "swarm/averager.py makes its reads blocking (uvloop made them not)"),
    (DecentralizedAverager, "_averaged_tensors", "swarm/averager.py reads the buffers back"),
    (DecentralizedAverager, "_matchmaking", "swarm/averager.py hands it to round_process.py, access.py, patience.py"),
    (DecentralizedAverager, "_pending_groups_registered", "swarm/averager.py hands it to round_process.py, registry.py"),
    (DecentralizedAverager, "_running_groups", "swarm/averager.py hands it to round_process.py, registry.py"),
    (DecentralizedAverager, "_allreduce_timeout", "swarm/averager.py hands it to round_process.py"),
    (DecentralizedAverager, "_p2p", "swarm/averager.py (the all-reduce runners and the chunk fetcher's stubs)"),
    (Matchmaking, "step_control", "swarm/access.py"),
    (Matchmaking, "lock_request_join_group", "swarm/quorum.py takes it to form a group early"),
    (Matchmaking, "assembled_group", "swarm/quorum.py"),
    (Matchmaking, "current_leader", "swarm/quorum.py"),
    (Matchmaking, "current_followers", "swarm/quorum.py; tests/swarm_helpers/peer.py's stall hook"),
    (Matchmaking, "request_timeout", "tests/swarm_helpers/peer.py's stall hook"),
    (Matchmaking, "is_looking_for_group", "swarm/quorum.py"),
    (Matchmaking, "group_key_manager", "swarm/protocol.py (use_round_key: a matchmaking key per round)"),
    (GroupKeyManager, "group_bits", "swarm/protocol.py sets it per round; current_key is built from it"),
    (AllReduceRunner, "_future", "swarm/runner.py"),
    (AllReduceRunner, "tensor_part_container", "swarm/runner.py"),
    (TensorPartContainer, "_input_parts_by_peer", "swarm/runner.py, swarm/verify.py"),
    (TensorPartContainer, "_outputs_registered_by_peer", "swarm/runner.py"),
    (TensorPartContainer, "_output_parts_by_peer", "tests/unit/test_bounds.py"),
    (RSASignatureValidator, "_private_key", "swarm/signing.py (a guard without a key)"),
    (RSASignatureValidator, "_local_public_key", "swarm/signing.py"),
    (RSASignatureValidator, "_PUBLIC_KEY_RE", "swarm/signing.py"),
    (RSASignatureValidator, "_SIGNATURE_RE", "swarm/signing.py"),
    (RSAPrivateKey, "_private_key", "swarm/signing.py restores a key through __setstate__"),
    (P2P, "_client", "cli/doctor.py dials a peer with it"),
    (MPFuture, "_active_pid", "tests/conftest.py reads it (fresh MPFuture locks once no forked child is left)"),
]
# Public-named internals that swarm/patience.py replaces on live instances (the averager process's matchmaking):
# not private by name, but nothing promises that hivemind keeps reading them where the patch expects.
PATCHED_METHODS = [
    (Matchmaking, "get_request_expiration_time", "swarm/patience.py wraps it on the instance (declares longer)"),
    (PotentialLeaders, "begin_search", "swarm/patience.py wraps it on the instance (ends the search early)"),
]
PATCHED_FIELDS = [
    (Matchmaking, "potential_leaders", "swarm/patience.py reads it to patch the PotentialLeaders instance; "
     "swarm/quorum.py reads its declared expiration"),
    (PotentialLeaders, "declared_expiration_time",
     "swarm/quorum.py reads it (a peer that stepped back takes no follower until it declares again)"),
    (PotentialLeaders, "search_end_time", "swarm/patience.py moves it earlier and reads it"),
]
# Overrides must keep hivemind's parameters: hivemind calls them.
SIGNATURES = {
    (DecentralizedAverager, "_shutdown"): ["self", "timeout"],
    (DecentralizedAverager, "run"): ["self"],
    (DecentralizedAverager, "_get_current_state_from_host_process"): ["self"],
    (Matchmaking, "get_request_expiration_time"): ["self"],  # replaced by a lambda taking nothing
}


def test_p2p_daemon_command_line_takes_the_flags_the_relay_settings_add() -> None:
    """swarm/relay.py adds ``relayDiscovery`` to the keyword flags hivemind turns into ``-key=value``."""
    args = P2P._make_process_args("p2pd", autoRelay=True, relayDiscovery=False, trustedRelays="/ip4/1.2.3.4")
    assert args == ["p2pd", "-autoRelay=1", "-relayDiscovery=0", "-trustedRelays=/ip4/1.2.3.4"]
    assert "force_reachability" in inspect.signature(P2P.create).parameters
    assert "trusted_relays" in inspect.signature(P2P.create).parameters


def _assigned(cls: type, name: str) -> bool:
    """``name`` is a class attribute, or some method of the class (or a base) assigns ``self.name``."""
    if name in vars(cls) or any(name in vars(base) for base in cls.__mro__):
        return True
    # ``self.name = ...``, ``self.name: T = ...`` or the first of ``self.name, self.other = ...``
    pattern = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?(,\s*self\.\w+\s*)*=(?!=)")
    return any(pattern.search(inspect.getsource(base)) for base in cls.__mro__
               if base.__module__.startswith("hivemind"))


def test_hivemind_version_is_supported() -> None:
    version = Version(hivemind.__version__)
    assert Version("1.1.10") <= version < Version("1.2"), f"hivemind {version}: supported are >= 1.1.10, < 1.2"


@pytest.mark.parametrize("cls, name, where", METHODS, ids=[f"{c.__name__}.{n}" for c, n, _ in METHODS])
def test_private_method_exists(cls: type, name: str, where: str) -> None:
    assert callable(getattr(cls, name, None)), f"hivemind's {cls.__name__}.{name} is gone; used by {where}"


@pytest.mark.parametrize("cls, name, where", FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _ in FIELDS])
def test_private_field_exists(cls: type, name: str, where: str) -> None:
    assert _assigned(cls, name), f"hivemind's {cls.__name__} no longer sets {name}; used by {where}"


@pytest.mark.parametrize("cls, name, where", PATCHED_METHODS, ids=[f"{c.__name__}.{n}" for c, n, _ in PATCHED_METHODS])
def test_patched_method_exists(cls: type, name: str, where: str) -> None:
    assert callable(getattr(cls, name, None)), f"hivemind's {cls.__name__}.{name} is gone; used by {where}"
    uses = {"get_request_expiration_time": Matchmaking, "begin_search": Matchmaking}
    # The patch works only while hivemind calls it through the instance (``self.name(`` / ``.name(``).
    assert re.search(rf"\.{name}\(", inspect.getsource(uses[name])), f"hivemind no longer calls {name} by attribute"


@pytest.mark.parametrize("cls, name, where", PATCHED_FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _ in PATCHED_FIELDS])
def test_patched_field_exists(cls: type, name: str, where: str) -> None:
    assert _assigned(cls, name), f"hivemind's {cls.__name__} no longer sets {name}; used by {where}"


@pytest.mark.parametrize("key", list(SIGNATURES), ids=[f"{c.__name__}.{n}" for c, n in SIGNATURES])
def test_overridden_methods_keep_their_parameters(key: tuple[type, str]) -> None:
    cls, name = key
    assert list(inspect.signature(getattr(cls, name)).parameters) == SIGNATURES[key], f"{cls.__name__}.{name}"


def test_compression_table_has_the_slot_the_codec_adapter_takes() -> None:
    from p2p_diloco.swarm.hivemind_codecs import HIVEMIND_SLOT

    table = serialization._BASE_COMPRESSION_TYPES  # swarm/hivemind_codecs.py installs its codec here
    assert HIVEMIND_SLOT in table, "hivemind's compression table lost the slot swarm/hivemind_codecs.py uses"


def _defined_names(text: str) -> set[str]:
    """Private names a module of ours defines: ``def _x``, ``class _X``, ``self._x = ...`` (also annotated, or
    in a tuple of ``self.`` targets) and module or class level ``_x = ...``. A call ``self._x(...)`` defines
    nothing: it is how an override calls the hivemind method it inherits."""
    names = set(re.findall(r"(?:def|class)\s+(_[a-zA-Z]\w*)", text))
    names.update(re.findall(r"^\s*(_[a-zA-Z]\w*)\s*(?::[^=\n]*)?=(?!=)", text, re.MULTILINE))
    for targets in re.findall(r"^\s*((?:self\.\w+\s*,\s*)*self\.\w+)\s*(?::[^=\n]*)?=(?!=)", text, re.MULTILINE):
        names.update(n for n in re.findall(r"self\.(\w+)", targets) if n.startswith("_"))
    return names


def test_the_self_check_counts_a_call_as_theirs() -> None:
    """The check below must not take a call of an inherited private method for a definition of ours."""
    text = "class A(B):\n    def _mine(self):\n        self._field: int = 1\n        self._a, self._b = 1, 2\n" \
           "        return self._inherited(self._other)\n"
    assert _defined_names(text) == {"_mine", "_field", "_a", "_b"}


def test_the_swarm_layer_uses_no_other_hivemind_private_name() -> None:
    """Any ``._name`` in p2p_diloco that hivemind defines must be in the tables above (or be our own)."""
    from pathlib import Path

    import p2p_diloco

    named = {n for _, n, _ in METHODS + FIELDS} | {"_BASE_COMPRESSION_TYPES"}
    hivemind_root = Path(hivemind.__file__).parent
    theirs = set()
    for path in hivemind_root.rglob("*.py"):
        theirs.update(re.findall(r"(?:def |self\.)(_[a-zA-Z]\w*)", path.read_text()))
    ours_defined, used = set(), {}
    for path in Path(p2p_diloco.__file__).parent.rglob("*.py"):
        text = path.read_text()
        ours_defined.update(_defined_names(text))
        for name in re.findall(r"\.(_[a-zA-Z]\w*)", text):
            used.setdefault(name, path.name)
    unnamed = {n: f for n, f in used.items() if n in theirs and n not in named and n not in ours_defined}
    assert not unnamed, f"hivemind private names used but not listed in this tripwire: {unnamed}"


def test_the_averager_process_is_made_where_hivemind_s_loop_runs() -> None:
    """``RoundAverager.run`` makes the averager process's side, then calls hivemind's ``run``: that must run
    hivemind's loop (``_run_internal``) in this same process (a thread of it), where the RPC handlers and
    commands then find that side."""
    run = inspect.getsource(DecentralizedAverager.run)
    assert "_run_internal" in run and "Process(" not in run, "hivemind's run() no longer runs its loop here"


def test_the_averager_process_runs_a_command_by_its_method_name() -> None:
    """``swarm/commands.py`` sends ``(name, args, kwargs)`` and relies on hivemind's background loop running
    ``getattr(self, name)(*args, **kwargs)`` as a task (our commands all go to ``RoundAverager._run_command``)."""
    loop = inspect.getsource(DecentralizedAverager._run_internal)
    assert "method, args, kwargs = self._inner_pipe.recv()" in loop, "the command pipe's protocol changed"
    assert "getattr(self, method)(*args, **kwargs)" in loop, "commands are no longer run by method name"


def test_a_peer_that_steps_back_declares_late_and_so_follows() -> None:
    """``swarm/quorum.py`` (``EarlyAssembly._step_back``) relies on two behaviours, not names: hivemind declares
    a searching peer until its step's ``scheduled_time`` (read again at every declaration), and a leader
    admits only followers whose declaration ends no earlier than its own."""
    declare = inspect.getsource(PotentialLeaders._declare_averager_periodically)
    assert "step.scheduled_time" in declare, "declarations no longer follow StepControl.scheduled_time"
    admit = inspect.getsource(Matchmaking._check_reasons_to_reject)
    assert re.search(r"declared_expiration_time\s*>\s*\(?request\.expiration", admit), (
        "leaders no longer turn away followers whose declaration ends before theirs")


def test_a_follower_closes_its_join_stream() -> None:
    """``swarm/patience.py`` (``hold_until_follower_closes``) holds a leader's join stream open after
    BEGIN_ALLREDUCE and relies on the follower closing its stream once it has its answer. The other half, the
    server cancelling the handler on that close, is ``swarm/bounded_rpc.py``'s own
    (``tests/unit/test_bounded_rpc.py::test_the_callers_close_cancels_a_running_handler``)."""
    follower = inspect.getsource(Matchmaking._request_join_group)
    assert re.search(r"finally:[\s\S]*await stream\.aclose\(\)", follower), "followers no longer close the stream"


def test_one_request_rpcs_are_served_under_hivemind_s_names_and_framing() -> None:
    """``swarm/bounded_rpc.py`` serves ``rpc_join_group``, ``rpc_download_state`` and ``rpc_state_chunk`` in
    place of hivemind's wrapper: under the protocol name hivemind's stubs call, in hivemind's message framing
    (a marker byte, an 8-byte length, the message; the request followed by ``END_OF_STREAM``), and only
    because hivemind's servicer registers those three as unary-input, streamed-output handlers."""
    from p2p_diloco.swarm import RoundAverager
    from p2p_diloco.swarm.access import rpc_handle_name
    from p2p_diloco.swarm.bounded_rpc import BOUNDED_RPCS

    for rpc in BOUNDED_RPCS:
        assert rpc_handle_name("ns", "RoundAverager", rpc) == RoundAverager._get_handle_name("ns", rpc)
    assert rpc_handle_name(None, "RoundAverager", "rpc_x") == RoundAverager._get_handle_name(None, "rpc_x")
    RoundAverager._collect_rpc_handlers()
    kinds = {h.method_name: (h.stream_input, h.stream_output) for h in RoundAverager._rpc_handlers}
    assert all(kinds[rpc] == (False, True) for rpc in BOUNDED_RPCS), kinds
    assert (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER, P2P.HEADER_LEN, P2P.BYTEORDER) == (b"\x00", b"\x01", 8, "big")
    client = inspect.getsource(P2P._iterate_protobuf_stream_handler)
    assert "send_protobuf(P2P.END_OF_STREAM, writer)" in client, "hivemind's client no longer ends its requests"
