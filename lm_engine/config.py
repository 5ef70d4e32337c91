"""Engine settings; flag names follow vLLM where the meaning is the same."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime import dtypes


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # the checkpoint's own dtype, or float32 on a CPU that is slow at it (resolve_dtype)
    device: str = "cpu"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # fixed pool size (tests); otherwise measured after warm-up
    kv_cache_memory: int | None = None  # bytes for the KV pool; otherwise from memory_utilization
    # The share of the memory available at start (CPU: MemAvailable before any weight is read; CUDA: the device's
    # total) that weights, warm-up activations, the server's own needs and the KV pool may take together
    # (lm_engine/memory.py: kv_budget_bytes). NOTE: 0.9, vLLM's default for gpu_memory_utilization: on a CPU the
    # other 10 % stays with the system and other processes, and absorbs the error of the kernel's estimate (the
    # page cache it counts as available is not all reclaimable at once); a 16.6 GB 7B checkpoint then serves on a
    # 24 GiB machine with a KV pool of a few GiB, where 0.5 would leave none.
    memory_utilization: float = 0.9
    attention_backend: str = "auto"
    warmup_image_patches: int = 4096
    # Vision path
    preprocess_workers: int = 0  # processes for decode/resize; 0 = threads in this process
    embedding_cache_bytes: int = 512 << 20  # L1 (in-process) embedding cache
    redis_url: str | None = None  # optional L2 shared by replicas
    redis_key_prefix: str = "vlmserve:"
    # Identity hash of image bytes, embedding keys and prefix-cache blocks (preprocess.hashing.HASH_ALGORITHMS;
    # this default is its DEFAULT_HASH, which a test holds equal). "xxh3" is for trusted clients only: its
    # collisions can be built, and a colliding image is answered from another's embeddings and KV.
    hash_algorithm: str = "blake3"
    # Video (preprocess/video.py): frames sampled per second unless a request asks (None: the checkpoint's video
    # processor's, else 2), and what one video may be: frames sampled, seconds, pixels per source frame, visual
    # tokens after sampling and resizing.
    video_fps: float | None = None
    video_max_frames: int = 64
    video_max_duration_s: float = 600.0
    video_max_frame_pixels: int = 3840 * 2160
    video_max_tokens: int = 16384
    encoder_max_batch_patches: int = 16384
    encoder_max_wait_ms: float = 2.0
    # Encoder tier: send cache misses to a `vlmserve encoder` pool at this URL (tcp://host:port, unix:///path),
    # or start a local pool of this many worker processes; default: encode in-process.
    encoder_url: str | None = None
    encoder_workers: int = 0
    encoder_threads: int = 0  # torch threads per worker of the encoder_workers pool (0: torch's own)
    encoder_nice: int = 10  # the encoder_workers pool's lower CPU priority (decode steps preempt encoding)
    encoder_timeout_s: float = 30.0  # the longest an image waits for the pool before the fallback
    encoder_fallback: str = "local"  # "local": encode in-process then; "fail": the request gets a 503
    encoder_auth_token_file: str | None = None  # the encoder pool's shared secret (encoder/tier/auth.py)
    # Load: visual budget controller and admission control
    # "adaptive" lowers new images' max_pixels under load (the server's default); "fixed" (offline default)
    # gives every image the configured maximum, as a batch job with no latency target wants.
    visual_budget: str = "fixed"
    visual_ladder: tuple[int, ...] | None = None  # max_pixels per level; default 100/50/25 %/minimum
    # Under "fixed": the ladder level detail="auto" images get (0 = full); "high" and "low" still mean 0 and the
    # lowest. Pins a budget for an operator or a quality measurement.
    visual_level: int = 0
    ttft_slo_ms: float = 2000.0
    # Refuse new work while the prefill work queued ahead of it would take longer than ttft_slo_ms (a request
    # admitted then would only miss its target). None: with an adaptive visual budget only, so a "fixed" one
    # is the plain baseline unless asked.
    slo_admission: bool | None = None
    # Per-output-token target: while requests decode, a step carries only the prefill that fits this time at
    # the measured prefill rate (a long prefill chunk stalls every stream for its length). None: no cap.
    tpot_slo_ms: float | None = None
    budget_dwell_s: float = 1.0
    # Admission bounds on queued work (None: unbounded, as offline batches want; the server sets them).
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.visual_budget not in ("adaptive", "fixed"):
            raise ValueError(f"visual_budget must be 'adaptive' or 'fixed', got {self.visual_budget!r}")
        if self.visual_level < 0:
            raise ValueError(f"visual_level must be 0 or more, got {self.visual_level}")
        if self.visual_level and self.visual_budget != "fixed":
            raise ValueError(
                "visual_level pins the budget of a 'fixed' visual_budget; 'adaptive' moves it itself"
            )
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        from preprocess.hashing import check_algorithm  # here: the config module stays free of preprocess

        check_algorithm(self.hash_algorithm)
        if not 0 <= self.encoder_nice <= 19 or self.encoder_threads < 0:
            raise ValueError(
                f"encoder_nice must be 0-19 and encoder_threads 0 or more, got {self.encoder_nice}, "
                f"{self.encoder_threads}"
            )

    def resolve_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The compute dtype (:func:`runtime.dtypes.compute_dtype`)."""
        return dtypes.compute_dtype(self.dtype, checkpoint_dtype, self.device)
