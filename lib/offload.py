"""Weight offloading in ZeRO-Inference's way: the weights live in a slow tier and each transformer block's
weights are brought into a small fast buffer just before the block runs, the next block's read
overlapping the current block's compute (double buffering).

The slow tier: on CUDA, pinned CPU memory (copies with non_blocking=True on a side stream, events to
order them); on CPU, a memory-mapped safetensors file on disk, read by a background thread, each block's
pages dropped from the process and from the page cache once copied, so that the next pass reads the disk
again. The embeddings, the final LayerNorm and the head stay resident (about 4% of the cpu preset).

The model is an ordinary GPTlite_KVCache whose blocks' parameters are views of the buffers ("slots"):
block i computes in slot i % n_slots, and a forward pre-hook waits for its weights there. Nothing else
of the cached forward pass changes, so prefill, decode_one_token and generate_kvcache run as they are.
"""
import ctypes
import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache
from lib.errors import CheckpointError
from lib.files import atomic_file, checkpoint_sha256

FORMAT = "gptlite-offload/1"  # the file's metadata "format": what this module writes and reads
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def weights_sha256(model):
    """The identity of a model's weights: sha256 over its config and every tensor (files.checkpoint_sha256)."""
    return checkpoint_sha256(model.config.to_dict(), None, model.state_dict())


def write_offload_file(model, path):
    """Write the model's state dict as safetensors, with its config and weights' sha256 in the metadata;
    atomically (temp file, synced, renamed): a failed or killed write leaves no file, or the old one."""
    state = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    metadata = {"format": FORMAT, "config": json.dumps(model.config.to_dict(), sort_keys=True),
                "sha256": weights_sha256(model)}
    with atomic_file(path) as tmp:
        save_file(state, str(tmp), metadata=metadata)
        tmp.chmod(0o644)  # safetensors creates it private; the checkpoints beside it are readable


def read_header(path, hint):
    """Check a safetensors file's framing before anything maps it: the 8-byte header length, the JSON
    header, and the file size against the header's last tensor (a truncated file is refused here).
    Returns ({name: (dtype, shape, start, end)} with absolute byte offsets, the metadata dict)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no offload file at {path}; {hint}")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"its header claims {n} bytes, the file has {size - 8} after the length")
            header = json.loads(f.read(n))
        metadata = header.pop("__metadata__", None) or {}
        start = 8 + n  # the data follow the header; offsets count from there
        tensors = {name: (DTYPES[t["dtype"]], tuple(t["shape"]), start + t["data_offsets"][0],
                          start + t["data_offsets"][1]) for name, t in header.items()}
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a readable offload file (truncated or not safetensors: "
                              f"{type(e).__name__}: {e}); {hint}") from None
    end = max((t[3] for t in tensors.values()), default=8 + n)
    if end != size:
        raise CheckpointError(f"{path} is truncated or damaged: {size} bytes where its header describes {end}; {hint}")
    return tensors, metadata


class OffloadFile:
    """The slow tier on disk: a safetensors file of a GPTlite's weights, checked (framing, config, tensor
    names and shapes, sha256 of the bytes) before use, then memory-mapped; `views` are tensors over the
    mapping (reading one reads the file)."""

    def __init__(self, path, config, sha256=None, hint="delete it and run again to have it written"):
        self.path = Path(path)
        tensors, metadata = read_header(self.path, hint)
        if metadata.get("format") != FORMAT or "config" not in metadata or "sha256" not in metadata:
            raise CheckpointError(f"{self.path} was not written by lib/offload.py (no {FORMAT} metadata); {hint}")
        if json.loads(metadata["config"]) != dict(config):
            raise CheckpointError(f"{self.path} was written for another model (config {metadata['config']}, "
                                  f"expected {json.dumps(dict(config), sort_keys=True)}); {hint}")
        expected = {name: (p.dtype, tuple(p.shape)) for name, p in GPTlite_KVCache(**config).state_dict().items()}
        if {name: t[:2] for name, t in tensors.items()} != expected:
            raise CheckpointError(f"{self.path} holds other tensors than a GPTlite of its config; {hint}")
        self.fd = os.open(self.path, os.O_RDONLY)
        self.mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY)  # private and writable: torch.frombuffer's need
        self.views = {name: torch.frombuffer(self.mm, dtype=dtype, count=(end - start) // dtype.itemsize,
                                             offset=start).view(shape)
                      for name, (dtype, shape, start, end) in tensors.items()}
        self.ranges = {name: t[2:] for name, t in tensors.items()}
        self.sha256 = metadata["sha256"]
        if checkpoint_sha256(dict(config), None, self.views) != self.sha256:  # reads every byte once
            self.close()
            raise CheckpointError(f"{self.path} is damaged: its bytes do not match the sha256 it was written with; "
                                  f"{hint}")
        if sha256 is not None and self.sha256 != sha256:
            self.close()
            raise CheckpointError(f"{self.path} holds the weights of another model than the one loaded (its sha256 "
                                  f"{self.sha256[:12]}, the model's {sha256[:12]}); {hint}")
        self.drop()
        address = ctypes.c_char.from_buffer(self.mm)
        self.address = ctypes.addressof(address)  # the mapping's start, to find it in /proc/self/smaps
        del address

    def drop(self, end=0):
        """Unmap every page of the file from this process (fault-around maps neighbours of what was read),
        and drop its bytes [0, end) from the page cache (0: all): the next read of them goes to the disk.
        What the kernel's readahead brought in past `end` (the next block's first pages) stays: the disk
        did read it, once."""
        self.mm.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self.fd, 0, end, os.POSIX_FADV_DONTNEED)

    def block_end(self, i):
        """The end of block i's bytes in the file (safetensors orders tensors by name: blocks.0. first)."""
        return max(end for name, (start, end) in self.ranges.items() if name.startswith(f"blocks.{i}."))

    def resident_bytes(self):
        """Bytes of the mapping resident in this process now (Rss in /proc/self/smaps); None off Linux."""
        try:
            with open("/proc/self/smaps") as f:
                inside = False
                for line in f:
                    if "-" in line.split(" ", 1)[0] and not line[0].isupper():  # a mapping's header line
                        inside = int(line.split("-", 1)[0], 16) == self.address
                    elif inside and line.startswith("Rss:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def close(self):
        self.views = {}  # the mapping cannot close while a tensor views it
        self.mm.close()
        os.close(self.fd)


class BlockStreamer:
    """Streams the blocks' weights of a GPTlite_KVCache into `n_slots` buffers: 2 with `prefetch` (block
    i+1 is read while block i computes), 1 without (each block read, then computed). Subclasses read from
    their tier: `_start(i, slot)` begins a read and returns a job, `_finish(job)` waits for it and returns
    its transfer seconds (or what gives them later), `_released(slot)` marks the end of a block's compute.

    Counters (reset_stats, stats): forward passes, the bytes of the blocks each pass consumed, the transfer
    time of those reads and the time the compute waited for them."""

    def __init__(self, model, prefetch=True):
        self.model, self.prefetch, self.n_blocks = model, prefetch, len(model.blocks)
        n_slots = 2 if prefetch else 1
        self.device = device = model.fc_out.weight.device
        first = dict(model.blocks[0].named_parameters())
        self.slots = [{name: torch.empty_like(p, device=device) for name, p in first.items()} for _ in range(n_slots)]
        for i, block in enumerate(model.blocks):  # block i computes in slot i % n_slots
            for name, p in block.named_parameters():
                p.data = self.slots[i % n_slots][name]
        self.block_bytes = sum(t.nbytes for t in self.slots[0].values())
        self.filled = [None] * n_slots  # the block each slot holds or is receiving
        self.jobs = [None] * n_slots  # its read, until a pass consumes it
        self.hooks = [block.register_forward_pre_hook(lambda m, args, i=i: self.before(i)) for i, block in
                      enumerate(model.blocks)]
        self.hooks += [block.register_forward_hook(lambda m, args, out, i=i: self.after(i)) for i, block in
                       enumerate(model.blocks)]
        self.reset_stats()

    def slot(self, i):
        return i % len(self.slots)

    def start(self, i):
        """Start reading block i into its slot, unless that read is already in flight (or done, unconsumed)."""
        s = self.slot(i)
        if self.jobs[s] is None or self.filled[s] != i:
            self.filled[s], self.jobs[s] = i, self._start(i, s)

    def before(self, i):
        """Block i is about to run: its weights must be in its slot; then start the next block's read if
        its slot is free (with 2 slots it is: the block before this one is done)."""
        self.start(i)  # without prefetch (or on the first pass) the read starts only now
        s = self.slot(i)
        job, self.jobs[s] = self.jobs[s], None  # consumed: the next pass reads the block again
        with iu.Timer() as waiting:
            self.transfers.append(self._finish(job))
        self.waited += waiting.seconds
        self.passes += i == 0
        self.streamed_bytes += self.block_bytes
        nxt = (i + 1) % self.n_blocks  # after the last block, block 0 of the next pass
        if self.prefetch and self.slot(nxt) != self.slot(i):
            self.start(nxt)

    def after(self, i):
        s = self.slot(i)
        self._released(s)
        nxt = (i + 1) % self.n_blocks
        if self.prefetch and self.slot(nxt) == s:  # an odd block count: the next block shares this slot
            self.start(nxt)

    def drain(self):
        """Wait for the reads in flight (a prefetch of the next pass's first block), which stay usable."""
        for job in self.jobs:
            if job is not None:
                self._finish(job)

    def reset_stats(self):
        self.passes, self.streamed_bytes, self.waited, self.transfers = 0, 0, 0.0, []

    def stats(self):
        """{passes, streamed_bytes, transfer_s, waited_s, hidden (share of transfer time the compute did
        not wait for; None before any transfer)}."""
        transfer = sum(self._seconds(t) for t in self.transfers)
        hidden = None if transfer <= 0 else max(0.0, 1 - self.waited / transfer)
        return dict(passes=self.passes, streamed_bytes=self.streamed_bytes, transfer_s=transfer,
                    waited_s=self.waited, hidden=hidden)

    def weight_bytes(self):
        """Bytes of weights held in memory: the resident part and the slots."""
        resident = sum(p.nbytes for name, p in self.model.named_parameters() if not name.startswith("blocks."))
        return resident + len(self.slots) * self.block_bytes

    def close(self):
        self.drain()
        for hook in self.hooks:
            hook.remove()


class DiskStreamer(BlockStreamer):
    """The CPU tier: a background thread copies block i's tensors from the mapped file into its slot, then
    drops those pages (drop_page_cache=False keeps them: reads then come from memory). The peak of the
    mapping's resident pages is sampled after each read when `measure_rss` is set (slow: reads smaps)."""

    def __init__(self, model, file, prefetch=True, drop_page_cache=True):
        super().__init__(model, prefetch)
        self.file, self.drop_page_cache = file, drop_page_cache
        self.reader = ThreadPoolExecutor(max_workers=1)
        self.measure_rss, self.peak_file_rss = False, 0

    def _start(self, i, s):
        return self.reader.submit(self.read, i, s)

    def read(self, i, s):
        with iu.Timer() as copying:
            for name, dst in self.slots[s].items():
                dst.copy_(self.file.views[f"blocks.{i}.{name}"])  # page faults: the disk is read here
        if self.measure_rss:  # before the drop: the most of the file this process holds (not timed)
            self.peak_file_rss = max(self.peak_file_rss, self.file.resident_bytes() or 0)
        with iu.Timer() as dropping:
            if self.drop_page_cache:  # blocks 0..i: the ones read up to now in this pass
                self.file.drop(self.file.block_end(i))
        return copying.seconds + dropping.seconds

    def _finish(self, job):
        return job.result()

    def _released(self, s):
        pass  # CPU ops are synchronous: the block is done when its forward hook runs

    @staticmethod
    def _seconds(t):
        return t

    def close(self):
        super().close()
        self.reader.shutdown()
        self.file.close()


class CudaStreamer(BlockStreamer):
    """The CUDA tier: every block's weights in pinned CPU memory; a side stream copies block i into its
    slot (non_blocking), after an event says the compute is done with the slot; the compute stream waits
    on the copy's event. Transfer and wait times are CUDA event timings, read at stats()."""

    def __init__(self, model, file, prefetch=True):
        super().__init__(model, prefetch)
        self.pinned = [{name: file.views[f"blocks.{i}.{name}"].clone().pin_memory() for name in self.slots[0]}
                       for i in range(self.n_blocks)]
        self.stream = torch.cuda.Stream(self.device)
        self.free = [torch.cuda.Event() for _ in self.slots]  # recorded when a slot's block has computed
        self.waits = []

    def _start(self, i, s):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.free[s])
            begin.record()
            for name, dst in self.slots[s].items():
                dst.copy_(self.pinned[i][name], non_blocking=True)
            end.record()
        return begin, end

    def _finish(self, job):
        compute = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(job[1])
        after.record(compute)
        self.waits.append((before, after))  # the compute stream's stall, on the GPU's clock
        return job

    def _released(self, s):
        self.free[s].record(torch.cuda.current_stream(self.device))

    @staticmethod
    def _seconds(job):
        return job[0].elapsed_time(job[1]) / 1e3

    def drain(self):
        self.stream.synchronize()

    def reset_stats(self):
        super().reset_stats()
        self.waits = []

    def stats(self):
        torch.cuda.synchronize(self.device)
        self.waited = sum(a.elapsed_time(b) for a, b in self.waits) / 1e3  # the host's wait is only the launch
        return super().stats()


def offloaded_model(path, config, device, prefetch=True, drop_page_cache=True, sha256=None, hint=None):
    """A GPTlite_KVCache of `config` on `device` whose blocks stream from the offload file at `path`
    (checked first: OffloadFile; `sha256`: the weights it must hold), and its streamer (DiskStreamer on
    CPU, CudaStreamer on CUDA). The embeddings, final LayerNorm and head are loaded from the file and
    stay resident."""
    file = OffloadFile(path, config, sha256, **({"hint": hint} if hint else {}))
    model = GPTlite_KVCache(**config)
    resident = {name: t.clone() for name, t in file.views.items() if not name.startswith("blocks.")}
    model.load_state_dict(resident, strict=False)  # the blocks' parameters become slot views below
    model.to(device).eval()
    file.drop()  # the copies above read those pages
    if torch.device(device).type == "cuda":
        streamer = CudaStreamer(model, file, prefetch)
        file.close()  # the pinned copies are the slow tier now
    else:
        streamer = DiskStreamer(model, file, prefetch, drop_page_cache)
    return model, streamer
