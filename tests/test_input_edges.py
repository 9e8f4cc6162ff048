"""Input the option and value checks used to take: copies of a config, JSON naming a key twice, a 0-d bool
tensor as an int, a layer synchronizer's timeout (reliability rows 243-246)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
import ssl
import time

import pytest
import torch

from aio_datadist import LLMConfig, LLMDataDist, LLMRole
from aio_datadist.options import parse_options
from aio_datadist.ranktable import parse_rank_table
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.synchronizers import EventLayerSynchronizer
from aio_datadist.types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, LLMClusterInfo

INVALID = LLMStatusCode.LLM_PARAM_INVALID


def test_a_copied_config_keeps_its_settings_apart_from_the_original():
    """A base config copied per endpoint: before, the copy shared the original's settings (its one slot's
    dict), so the second endpoint's device and address overwrote the first's."""
    base = LLMConfig()
    base.device_id = 0
    base.listen_ip_info = "127.0.0.1:26000"
    base.ge_options = {"a": "1"}
    other = copy.copy(base)
    other.device_id = 1
    other.listen_ip_info = "127.0.0.1:26001"
    assert base.device_id == 0 and base.generate_options()["llm.listenIpInfo"] == "127.0.0.1:26000"
    assert other.generate_options()["llm.listenIpInfo"] == "127.0.0.1:26001"
    assert other.ge_options is base.ge_options  # a plain object's copy shares the values themselves

    deep = copy.deepcopy(base)
    deep.ge_options["b"] = "2"
    assert "b" not in base.ge_options


def test_a_deep_copy_shares_the_tls_contexts():
    """An SSLContext cannot be deep-copied: the copy shares it (before, deepcopy raised TypeError)."""
    config = LLMConfig()
    config.tls_client_context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    deep = copy.deepcopy(config)
    assert deep.tls_client_context is config.tls_client_context


def test_settings_given_to_the_original_after_a_copy_stay_there():
    """The other way round: the copy does not see what the original is given afterwards (a copy that looked
    settings up in the original's would take its later device id and address)."""
    base = LLMConfig()
    base.device_id = 0
    other = copy.copy(base)
    base.device_id = 1
    base.listen_ip_info = "127.0.0.1:26001"
    assert other.device_id == 0 and "llm.listenIpInfo" not in other.generate_options()


def test_a_deep_copy_shares_both_tls_contexts():
    """The server's context too (an accepting endpoint's config), each the copy's own setting."""
    config = LLMConfig()
    config.tls_server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    config.tls_client_context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    deep = copy.deepcopy(config)
    assert deep.tls_server_context is config.tls_server_context
    assert deep.tls_client_context is config.tls_client_context


@pytest.mark.parametrize(("text", "key"), [
    ('{"1": "127.0.0.1:26001", "1": "127.0.0.1:27001"}', "1"),
    ('{"10.0.0.2": "127.0.0.1:26001", "10.0.0.2": "127.0.0.1:9"}', "10.0.0.2"),
])
def test_rank_addresses_naming_a_rank_twice_are_refused(text: str, key: str) -> None:
    """Before, JSON's last value won: a typo sent one rank to the other's address without a word. The refusal
    names the key given twice (checked since an audit, 2026-12-06)."""
    twice = f"the key '{key}' twice"
    with pytest.raises(LLMException, match=twice) as info:
        parse_options({"aio.RankAddresses": text})
    assert info.value.status_code is INVALID and info.value.argument == "aio.RankAddresses"
    with pytest.raises(LLMException, match=twice) as info:
        LLMConfig().rank_addresses = text
    assert info.value.status_code is INVALID
    # a dict naming a rank as an int and as a str is refused too, while options passed through to LLM-DataDist
    # parse as before, their last value winning (audit, 2026-12-07: neither was looked at)
    with pytest.raises(LLMException, match="rank id 1 twice") as info:
        LLMConfig().rank_addresses = {1: "127.0.0.1:26001", "1": "127.0.0.1:27001"}
    assert info.value.status_code is INVALID and info.value.argument == "rank_addresses"
    parse_options({"llm.LocalCommRes": '{"version": "1.2", "version": "1.3"}'})  # does not raise


def test_a_rank_table_naming_a_key_twice_is_refused() -> None:
    device = '{"device_id": "0", "device_ip": "10.0.0.1", "device_ip": "10.0.0.9", "rank_id": "0"}'
    table = '{"server_list": [{"device": [%s]}]}' % device
    with pytest.raises(LLMException, match="'device_ip' twice") as info:
        parse_rank_table(table, [0])
    assert info.value.status_code is INVALID
    fixed = json.dumps({"server_list": [{"device": [{"device_id": "0", "device_ip": "10.0.0.1", "rank_id": "0"}]}]})
    assert list(parse_rank_table(fixed, [0])) == [0]


@pytest.mark.parametrize("build", [
    lambda b: CacheKeyByIdAndIndex(1, 1, b),
    lambda b: CacheKey(1, b),
    lambda b: BlocksCacheKey(1, b),
    lambda b: setattr(LLMClusterInfo(), "remote_cluster_id", b),
], ids=["batch_index", "req_id", "model_id", "remote_cluster_id"])
def test_a_torch_bool_scalar_is_not_an_int(build):
    """Before, a 0-d bool tensor (``(t == x).any()``) passed as 0 or 1 where ``np.True_`` and ``True`` did not."""
    with pytest.raises(LLMException) as info:
        build(torch.tensor(True))
    assert info.value.status_code is INVALID and isinstance(info.value, TypeError)
    build(torch.tensor(3))  # a 0-d integer tensor is still an int


@pytest.mark.parametrize("build", [
    lambda b: CacheKeyByIdAndIndex(1, 1, b),
    lambda b: CacheKey(1, b),
    lambda b: setattr(LLMConfig(), "sync_kv_timeout", b),
], ids=["batch_index", "req_id", "sync_kv_timeout"])
def test_a_one_element_tensor_is_not_an_int(build):
    """torch takes ``torch.tensor([3])`` (any shape of one element) as the index 3; an argument that is one
    number is not a list of them (found by a hunt: it passed where ``np.array([3])`` did not)."""
    for value in (torch.tensor([3]), torch.tensor([[3]])):
        with pytest.raises(LLMException, match="shape") as info:
            build(value)
        assert info.value.status_code is INVALID and isinstance(info.value, TypeError)
    build(torch.tensor(3))


@pytest.mark.parametrize(("argument", "build"), [
    ("batch_index", lambda b: CacheKeyByIdAndIndex(1, 1, b)),
    ("req_id", lambda b: CacheKey(1, b)),
    ("model_id", lambda b: BlocksCacheKey(1, b)),
    ("remote_cluster_id", lambda b: setattr(LLMClusterInfo(), "remote_cluster_id", b)),
    # a timeout, through check_sint (audit, 2026-12-07: the cases above go through check_uint only)
    ("sync_kv_timeout", lambda b: setattr(LLMConfig(), "sync_kv_timeout", b)),
])
def test_a_torch_bool_scalar_is_refused_naming_its_argument(argument, build):
    """The refusal names the argument the 0-d bool tensor was given as (audit, 2026-12-07: the test above
    looked at the code and the type only)."""
    with pytest.raises(LLMException, match=f"'{argument}'.*bool") as info:
        build(torch.tensor(True))
    assert info.value.argument == argument


@pytest.mark.asyncio
async def test_an_event_synchronizer_of_something_else_than_the_async_endpoint_is_refused_naming_it():
    """The blocking facade's ``LLMDataDist``, a manager or None given for ``datadist``: ``LLM_PARAM_INVALID`` naming
    it (a bare ``AttributeError`` before; found by a hunt, 2026-12-07)."""
    from aio_datadist import compat

    config = LLMConfig()
    config.device_id = 0
    config.device_type = "cpu"
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(config.generate_options())
        for wrong in (compat.LLMDataDist(LLMRole.PROMPT, 3), dd.kv_cache_manager, None):
            with pytest.raises(LLMException) as info:
                EventLayerSynchronizer(wrong, 2)
            assert info.value.status_code is INVALID and info.value.argument == "datadist", info.value


@pytest.mark.asyncio
async def test_synchronize_layer_checks_its_timeout():
    """Before: '5' raised a bare TypeError, nan waited without end on asyncio (a bare ValueError on uvloop)
    and True read 1 ms."""
    config = LLMConfig()
    config.device_id = 0
    config.device_type = "cpu"
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(config.generate_options())
        with EventLayerSynchronizer(dd, 2) as sync:
            for timeout in ("5", math.nan, True, -1, 2**31, 1.0):
                with pytest.raises(LLMException) as info:
                    await asyncio.wait_for(sync.synchronize_layer(0, timeout), 2)
                assert info.value.status_code is INVALID and info.value.argument == "timeout_in_millis"
        # 0 answers at once (not after the synchronizer's or the endpoint's own timeout), and 2**31 - 1 waits:
        # the test looked at 0 only within 2 s, which the endpoint's default also met (audit, 2026-12-07)
        for default in (None, 60_000):
            with EventLayerSynchronizer(dd, 2, timeout_ms=default) as sync:
                start = time.monotonic()
                assert await asyncio.wait_for(sync.synchronize_layer(0, 0), 5) is False  # 0: not recorded now
                assert time.monotonic() - start < 0.2
                waiting = asyncio.ensure_future(sync.synchronize_layer(0, 2**31 - 1))
                await asyncio.sleep(0.1)
                assert not waiting.done()
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
                # a recorded layer: 0 says True at once, and the timeout is still checked (audit, 2026-12-07:
                # the test looked at layers never recorded only, so a check or a 0 that skipped the layer passed)
                sync.record(1)
                assert await asyncio.wait_for(sync.synchronize_layer(1, 2**31 - 1), 5) is True
                assert await sync.synchronize_layer(1, 0) is True
                with pytest.raises(LLMException) as info:
                    await sync.synchronize_layer(1, "5")
                assert info.value.argument == "timeout_in_millis"


def test_a_copy_of_a_subclassed_config_keeps_its_class_and_attributes():
    """A site config that adds defaults in ``generate_options``: before, its copies were plain LLMConfigs."""
    class SiteConfig(LLMConfig):
        def generate_options(self):
            return {**super().generate_options(), "llm.Site": self.site}

    base = SiteConfig()
    base.device_id = 0
    base.site = "a"
    base.hosts = ["h1"]  # a mutable attribute: a copy shares it, a deep copy copies it (found by audit)
    for copied in (copy.copy(base), copy.deepcopy(base)):
        assert type(copied) is SiteConfig and copied.generate_options()["llm.Site"] == "a"
        copied.device_id = 1
        assert base.device_id == 0
    assert copy.copy(base).hosts is base.hosts
    deep = copy.deepcopy(base)
    assert deep.hosts == base.hosts and deep.hosts is not base.hosts


def test_a_copy_of_a_slotted_subclass_keeps_its_attributes():
    class SlottedSite(LLMConfig):
        __slots__ = ("site", "hosts")

        def generate_options(self):
            return {**super().generate_options(), "llm.Site": self.site}

    base = SlottedSite()
    base.device_id = 0
    base.site = "b"
    base.hosts = ["h1"]
    for copied in (copy.copy(base), copy.deepcopy(base)):
        assert type(copied) is SlottedSite and copied.generate_options()["llm.Site"] == "b"
    assert copy.copy(base).hosts is base.hosts
    deep = copy.deepcopy(base)
    assert deep.hosts == base.hosts and deep.hosts is not base.hosts

    class RackSite(SlottedSite):  # slots of its own beside its base's, one left unset (found by audit)
        __slots__ = ("rack",)

    rack = RackSite()
    rack.site, rack.rack = "c", rack  # a reference back to itself: a deep copy's points at the copy
    for copied in (copy.copy(rack), copy.deepcopy(rack)):
        assert (type(copied), copied.site, hasattr(copied, "hosts")) == (RackSite, "c", False)
    assert copy.copy(rack).rack is rack
    deep = copy.deepcopy(rack)
    assert deep.rack is deep


@pytest.mark.parametrize("key", ["aio.SharedSecrett", "aio.sharedsecret", "AIO.SharedSecret", "Aio.SharedSecret",
                                 " aio.SharedSecret", "aio.SharedSecret ", "aio .SharedSecret", "\taio.SharedSecret"])
def test_an_aio_option_spelled_wrong_in_any_way_is_refused(key: str) -> None:
    """The typo guard: an ``aio.`` key we do not know is refused, naming it, also in another case or with spaces
    (before, only the exact prefix ``aio.`` was guarded: ``AIO.SharedSecret`` passed through as an unknown key and
    the endpoint listened without a secret; found by the options audit, 2026-12-06). Unknown ``llm.`` / ``ge.``
    keys still pass through, as LLM-DataDist passes them on."""
    with pytest.raises(LLMException, match="unknown aio option") as info:
        parse_options({key: "s3cret"})
    assert info.value.status_code is INVALID and info.value.argument == key
    assert parse_options({"aio.SharedSecret": "s3cret"}).shared_secret is not None
    assert parse_options({"llm.SomethingNew": "1", "ge.otherOption": "x"}).shared_secret is None


@pytest.mark.parametrize("key", ["\ufeffaio.SharedSecret", "\u200baio.SharedSecret", "aio\u200b.SharedSecret",
                                 "a\u00adio.SharedSecret", "aio\u2060.SharedSecret"])
def test_an_aio_option_with_an_invisible_character_is_refused(key: str) -> None:
    """The typo guard, for a key carrying a character that shows as nothing (a byte-order mark at the start of a
    config file's first line, a zero-width space or soft hyphen pasted from a web page): it passed through as an
    unknown key, and the endpoint listened without its secret."""
    with pytest.raises(LLMException, match="unknown aio option") as info:
        parse_options({key: "s3cret", "llm.listenIpInfo": "127.0.0.1:0"})
    assert info.value.status_code is INVALID and info.value.argument == key
