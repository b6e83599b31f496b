package mkernel

// #include <mkernel.h>
import "C"

import (
	"encoding/hex"
	"math"
	"sync"
	"unsafe"
)

// UniqueID names a communicator: 128 opaque bytes holding the bootstrap root's address and
// a random secret. Made by GetUniqueID on one rank and passed to the others out of band
// (it marshals to and from hex text). Treat it as a password: whoever holds it can join.
type UniqueID [C.sizeof_mkUniqueId]byte

// GetUniqueID creates a new id and starts its bootstrap root in this process
// (mkGetUniqueId). Call it once per communicator, on one rank.
func GetUniqueID() (UniqueID, error) {
	var id UniqueID
	cid := (*C.mkUniqueId)(unsafe.Pointer(&id))
	err := call("mkGetUniqueId", nil, func() C.mkResult_t { return C.mkGetUniqueId(cid) })
	return id, err
}

// String is the id in hex (256 characters).
func (id UniqueID) String() string { return hex.EncodeToString(id[:]) }

// MarshalText encodes the id as hex.
func (id UniqueID) MarshalText() ([]byte, error) { return []byte(id.String()), nil }

// UnmarshalText decodes an id from the hex of MarshalText.
func (id *UniqueID) UnmarshalText(text []byte) error {
	parsed, err := ParseUniqueID(string(text))
	if err == nil {
		*id = parsed
	}
	return err
}

// ParseUniqueID decodes an id from its hex String.
func ParseUniqueID(s string) (UniqueID, error) {
	var id UniqueID
	if len(s) != 2*len(id) {
		return id, argumentError("ParseUniqueID", "a unique id is %d hex characters, got %d", 2*len(id), len(s))
	}
	if _, err := hex.Decode(id[:], []byte(s)); err != nil {
		return id, argumentError("ParseUniqueID", "not hex: %v", err)
	}
	return id, nil
}

func (id *UniqueID) c() C.mkUniqueId { return *(*C.mkUniqueId)(unsafe.Pointer(id)) }

// Unset leaves an int field of Config to its environment variable or default.
const Unset = math.MinInt32

// Config is a communicator configuration for CommInitRank (mkConfig_t). Start from
// NewConfig, which leaves every field unset (Unset, or -1 for WorkspaceBytes), then set the
// fields you want. The meaning of each field is in include/mkernel.h.
type Config struct {
	TimeoutMs          int   // bound on every in-kernel wait for a peer (MK_TIMEOUT_MS)
	BootstrapTimeoutMs int   // bound on each bootstrap step (MK_BOOTSTRAP_TIMEOUT_MS)
	CommCtas           int   // CTAs dedicated to communication in fused kernels (MK_COMM_SMS)
	MaxCtas            int   // cap on any kernel's grid, for ranks sharing a GPU (MK_MAX_CTAS)
	RanksPerNode       int   // ranks per node (MK_RANKS_PER_NODE)
	WorkspaceBytes     int64 // symmetric workspace per rank (MK_WORKSPACE_BYTES); -1: unset
}

// NewConfig is the configuration mkConfigInit gives: every field unset.
func NewConfig() (Config, error) {
	var c C.mkConfig_t
	if err := call("mkConfigInit", nil, func() C.mkResult_t { return C.mkConfigInit(&c) }); err != nil {
		return Config{}, err
	}
	return Config{
		TimeoutMs:          int(c.timeoutMs),
		BootstrapTimeoutMs: int(c.bootstrapTimeoutMs),
		CommCtas:           int(c.commCtas),
		MaxCtas:            int(c.maxCtas),
		RanksPerNode:       int(c.ranksPerNode),
		WorkspaceBytes:     int64(c.workspaceBytes),
	}, nil
}

// c fills an mkConfig_t from mkConfigInit (size, magic, version) and the fields.
func (cfg *Config) c(op string) (C.mkConfig_t, error) {
	var c C.mkConfig_t
	if err := call("mkConfigInit", nil, func() C.mkResult_t { return C.mkConfigInit(&c) }); err != nil {
		return c, err
	}
	fields := []struct {
		name  string
		value int
		dst   *C.int
	}{
		{"TimeoutMs", cfg.TimeoutMs, &c.timeoutMs},
		{"BootstrapTimeoutMs", cfg.BootstrapTimeoutMs, &c.bootstrapTimeoutMs},
		{"CommCtas", cfg.CommCtas, &c.commCtas},
		{"MaxCtas", cfg.MaxCtas, &c.maxCtas},
		{"RanksPerNode", cfg.RanksPerNode, &c.ranksPerNode},
	}
	for _, f := range fields {
		if f.value < math.MinInt32 || f.value > math.MaxInt32 {
			return c, argumentError(op, "Config.%s = %d does not fit in a C int", f.name, f.value)
		}
		*f.dst = C.int(f.value)
	}
	c.workspaceBytes = C.longlong(cfg.WorkspaceBytes)
	return c, nil
}

// Comm is one rank of a communicator (mkComm_t). Its methods may be called from any
// goroutine; they are serialised, so that each failed call reads its own message. A nil or
// destroyed Comm is passed to the library as NULL, which rejects it.
type Comm struct {
	mu     sync.Mutex
	handle C.mkComm_t
}

// do runs one call on the communicator's handle, holding the lock through the call and the
// read of its message.
func (c *Comm) do(op string, f func(h C.mkComm_t) C.mkResult_t) error {
	if c == nil {
		return call(op, nil, func() C.mkResult_t { return f(nil) })
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return call(op, c.handle, func() C.mkResult_t { return f(c.handle) })
}

func newComm(h C.mkComm_t) *Comm { return &Comm{handle: h} }

// CommInitRank creates this process's rank of the communicator named by id, on the calling
// thread's current CUDA device (select it first, as with NCCL). It blocks until all nranks
// ranks have joined (bounded by the bootstrap timeout). cfg nil: defaults and environment.
//
// The current CUDA device is a property of the OS thread: lock the goroutine to its thread
// (runtime.LockOSThread) around selecting the device and this call.
func CommInitRank(nranks int, id UniqueID, rank int, cfg *Config) (*Comm, error) {
	const op = "mkCommInitRank"
	if nranks < math.MinInt32 || nranks > math.MaxInt32 || rank < math.MinInt32 || rank > math.MaxInt32 {
		return nil, argumentError(op, "nranks %d or rank %d does not fit in a C int", nranks, rank)
	}
	var h C.mkComm_t
	cid := id.c()
	if cfg == nil {
		err := call(op, nil, func() C.mkResult_t { return C.mkCommInitRank(&h, C.int(nranks), cid, C.int(rank)) })
		if err != nil {
			return nil, err
		}
		return newComm(h), nil
	}
	cc, err := cfg.c("mkCommInitRankConfig")
	if err != nil {
		return nil, err
	}
	err = call("mkCommInitRankConfig", nil, func() C.mkResult_t {
		return C.mkCommInitRankConfig(&h, C.int(nranks), cid, C.int(rank), &cc)
	})
	if err != nil {
		return nil, err
	}
	return newComm(h), nil
}

// CommInitAll creates len(devices) ranks of one communicator in this process: rank i on
// CUDA device devices[i]. A device may repeat (several ranks on one GPU).
func CommInitAll(devices []int) ([]*Comm, error) {
	const op = "mkCommInitAll"
	n := len(devices)
	if n > math.MaxInt32 {
		return nil, argumentError(op, "%d devices do not fit in a C int", n)
	}
	handles := make([]C.mkComm_t, n+1) // +1: a valid pointer even for no devices
	devs := make([]C.int, n+1)
	for i, d := range devices {
		if d < math.MinInt32 || d > math.MaxInt32 {
			return nil, argumentError(op, "device %d does not fit in a C int", d)
		}
		devs[i] = C.int(d)
	}
	// The slices hold no Go pointers, so C may write them during the call.
	err := call(op, nil, func() C.mkResult_t { return C.mkCommInitAll(&handles[0], C.int(n), &devs[0]) })
	if err != nil {
		return nil, err
	}
	comms := make([]*Comm, n)
	for i := range comms {
		comms[i] = newComm(handles[i])
	}
	return comms, nil
}

// Destroy releases the communicator (mkCommDestroy) once the work queued on it has
// completed (synchronise its streams first). The Comm is unusable afterwards.
func (c *Comm) Destroy() error {
	return c.do("mkCommDestroy", func(h C.mkComm_t) C.mkResult_t {
		r := C.mkCommDestroy(h)
		if r == C.mkSuccess {
			c.handle = nil
		}
		return r
	})
}

// Abort stops the communicator's kernels and peers' waits on it, then releases it like
// Destroy (mkCommAbort). Use it after an error or a timeout.
func (c *Comm) Abort() error {
	return c.do("mkCommAbort", func(h C.mkComm_t) C.mkResult_t {
		r := C.mkCommAbort(h)
		if r == C.mkSuccess {
			c.handle = nil
		}
		return r
	})
}

// AsyncError reports an error that happened inside a kernel (a peer timed out or failed):
// nil while none has, else an *Error with that code (mkTimeout, mkRemoteError, ...).
func (c *Comm) AsyncError() error {
	var async C.mkResult_t
	if err := c.do("mkCommGetAsyncError", func(h C.mkComm_t) C.mkResult_t {
		return C.mkCommGetAsyncError(h, &async)
	}); err != nil {
		return err
	}
	if async == C.mkSuccess {
		return nil
	}
	return &Error{Op: "mkCommGetAsyncError", Code: Result(async), Message: "mkCommGetAsyncError: a kernel of this communicator stopped: " + Result(async).Error()}
}

func (c *Comm) query(op string, f func(h C.mkComm_t, out *C.int) C.mkResult_t) (int, error) {
	var v C.int
	err := c.do(op, func(h C.mkComm_t) C.mkResult_t { return f(h, &v) })
	return int(v), err
}

// Count is the number of ranks (mkCommCount).
func (c *Comm) Count() (int, error) {
	return c.query("mkCommCount", func(h C.mkComm_t, v *C.int) C.mkResult_t { return C.mkCommCount(h, v) })
}

// Rank is this communicator's rank (mkCommUserRank).
func (c *Comm) Rank() (int, error) {
	return c.query("mkCommUserRank", func(h C.mkComm_t, v *C.int) C.mkResult_t { return C.mkCommUserRank(h, v) })
}

// Device is the CUDA device ordinal this rank runs on (mkCommCuDevice).
func (c *Comm) Device() (int, error) {
	return c.query("mkCommCuDevice", func(h C.mkComm_t, v *C.int) C.mkResult_t { return C.mkCommCuDevice(h, v) })
}
