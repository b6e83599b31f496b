package mkernel

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// mkError asserts that err is an *Error with the code, whose message contains want.
func mkError(t *testing.T, err error, code Result, want string) *Error {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("want an *Error with %v, got %v (%T)", code, err, err)
	}
	if e.Code != code || !errors.Is(err, code) {
		t.Fatalf("want %v, got %v: %v", code, e.Code, err)
	}
	if !strings.Contains(e.Message, want) {
		t.Fatalf("message %q lacks %q", e.Message, want)
	}
	return e
}

func TestVersionMatchesHeader(t *testing.T) {
	v, err := Version()
	if err != nil {
		t.Fatal(err)
	}
	if v != HeaderVersion || v <= 0 {
		t.Fatalf("library version %d, header MK_VERSION_CODE %d", v, HeaderVersion)
	}
}

func TestResultStrings(t *testing.T) {
	seen := map[string]Result{}
	for r := Success; r <= Timeout; r++ {
		text := r.Error()
		if text == "" || strings.Contains(text, "unknown") {
			t.Errorf("%v: description %q", r, text)
		}
		if other, dup := seen[text]; dup {
			t.Errorf("%v and %v share the description %q", r, other, text)
		}
		seen[text] = r
		if !strings.HasPrefix(r.String(), "mk") {
			t.Errorf("code %d is named %q", int32(r), r.String())
		}
	}
	if s := Result(99).Error(); !strings.Contains(s, "unknown") {
		t.Errorf("code 99: %q", s)
	}
	if s := Result(99).String(); s != "mkResult_t(99)" {
		t.Errorf("code 99 is named %q", s)
	}
}

func TestErrorCarriesCodeAndMessage(t *testing.T) {
	id, err := GetUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	_, err = CommInitRank(0, id, 0, nil)
	e := mkError(t, err, InvalidArgument, "nranks must be positive, got 0")
	if e.Op != "mkCommInitRank" {
		t.Errorf("Op %q", e.Op)
	}
	if errors.Is(err, SystemError) || errors.Is(err, InvalidUsage) {
		t.Errorf("%v matches another code", err)
	}
	if s := err.Error(); !strings.Contains(s, e.Message) || !strings.Contains(s, "mkInvalidArgument") {
		t.Errorf("Error() = %q", s)
	}
	_, err = CommInitRank(2, id, 2, nil)
	mkError(t, err, InvalidArgument, "out of range")
}

func TestUniqueIDRoundTrip(t *testing.T) {
	id, err := GetUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	other, err := GetUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	if id == other {
		t.Fatal("two unique ids are equal")
	}
	text, err := id.MarshalText()
	if err != nil {
		t.Fatal(err)
	}
	var back UniqueID
	if err := back.UnmarshalText(text); err != nil {
		t.Fatal(err)
	}
	if back != id {
		t.Fatal("the id changed through MarshalText / UnmarshalText")
	}
	// The library accepts the decoded id: joining fails for lack of a GPU (or succeeds on
	// one), never because the id is malformed, as a garbage id does.
	comm, err := CommInitRank(1, back, 0, nil)
	if err == nil {
		if err := comm.Destroy(); err != nil {
			t.Fatal(err)
		}
	} else if errors.Is(err, InvalidArgument) {
		t.Fatalf("the decoded id was rejected: %v", err)
	}
	var garbage UniqueID
	for i := range garbage {
		garbage[i] = 0x41
	}
	_, err = CommInitRank(1, garbage, 0, nil)
	mkError(t, err, InvalidArgument, "mkGetUniqueId")

	for _, bad := range []string{"", "00", strings.Repeat("zz", len(id))} {
		_, err := ParseUniqueID(bad)
		mkError(t, err, InvalidArgument, "ParseUniqueID")
	}
}

func TestConfigComesFromMkConfigInit(t *testing.T) {
	cfg, err := NewConfig()
	if err != nil {
		t.Fatal(err)
	}
	for name, v := range map[string]int{"TimeoutMs": cfg.TimeoutMs, "BootstrapTimeoutMs": cfg.BootstrapTimeoutMs,
		"CommCtas": cfg.CommCtas, "MaxCtas": cfg.MaxCtas, "RanksPerNode": cfg.RanksPerNode} {
		if v != Unset {
			t.Errorf("%s = %d, want Unset", name, v)
		}
	}
	if cfg.WorkspaceBytes != -1 {
		t.Errorf("WorkspaceBytes = %d, want -1", cfg.WorkspaceBytes)
	}
	id, err := GetUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	bad := cfg
	bad.TimeoutMs = -5
	_, err = CommInitRank(1, id, 0, &bad)
	mkError(t, err, InvalidArgument, "timeoutMs")
	bad = cfg
	bad.MaxCtas = math.MaxInt32 + 1
	_, err = CommInitRank(1, id, 0, &bad)
	mkError(t, err, InvalidArgument, "Config.MaxCtas")
}

// Without a GPU, init fails with the library's message saying why; with one, it succeeds
// and this test has nothing to check.
func TestInitWithoutGPU(t *testing.T) {
	comms, err := CommInitAll([]int{0})
	if err == nil {
		for _, c := range comms {
			c.Destroy()
		}
		t.Skip("SKIPPED: a GPU is present; the no-GPU error cannot happen here")
	}
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("%v (%T)", err, err)
	}
	// No driver (mkSystemError, naming libcuda.so.1), or a driver without a usable GPU.
	switch e.Code {
	case SystemError, UnhandledCudaError, InvalidUsage:
	default:
		t.Fatalf("unexpected %v", err)
	}
	if why := strings.TrimPrefix(e.Message, "mkCommInitAll: "); why == e.Message || len(why) < 20 {
		t.Fatalf("the message does not say why init failed: %q", e.Message)
	}
	t.Logf("init without a GPU: %v", err)
	// The same through mkCommInitRankConfig and a Config from mkConfigInit.
	cfg, err := NewConfig()
	if err != nil {
		t.Fatal(err)
	}
	id, err := GetUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	_, err = CommInitRank(1, id, 0, &cfg)
	mkError(t, err, e.Code, "mkCommInitRankConfig")

	_, err = CommInitAll(nil)
	mkError(t, err, InvalidArgument, "ndev must be positive")
}

func TestNilCommAndNegativeSizes(t *testing.T) {
	var c *Comm
	if _, err := c.Count(); err == nil {
		t.Fatal("Count on a nil Comm succeeded")
	} else {
		mkError(t, err, InvalidArgument, "comm is NULL")
	}
	err := c.AllReduce(0x1000, 0x1000, 8, Float32, Sum, 0)
	mkError(t, err, InvalidArgument, "mkAllReduce: comm is NULL")
	err = c.AllReduce(0x1000, 0x1000, -8, Float32, Sum, 0)
	mkError(t, err, InvalidArgument, "count is negative (-8)")
	err = Gemm(0x1000, 0x1000, 0x1000, 4, -2, 8, Bfloat16, 0)
	mkError(t, err, InvalidArgument, "n is negative (-2)")
	err = Gemm(0x1000, 0x1000, 0x1000, 1, 1, 8, DataType(77), 0)
	mkError(t, err, InvalidArgument, "unknown datatype 77")
}

func TestMoeLayoutBytesFollowsTheHeaderFormula(t *testing.T) {
	for _, s := range [][3]int{{1, 1, 128}, {37, 3, 256}, {4096, 8, 65536}} {
		got, err := MoeLayoutBytes(s[0], s[1], s[2])
		if err != nil {
			t.Fatal(err)
		}
		// include/mkernel.h: 4·(4 + 3·tokens·topk + 6·recvCapacity/128 + 1025).
		if want := 4 * (4 + 3*s[0]*s[1] + 6*s[2]/128 + 1025); got != want {
			t.Errorf("MoeLayoutBytes%v = %d, want %d", s, got, want)
		}
	}
}

// namesExactly: msg contains want not followed by another digit ("got -12" is not "got -1").
func namesExactly(msg, want string) bool {
	at := strings.Index(msg, want)
	if at < 0 {
		return false
	}
	rest := msg[at+len(want):]
	return rest == "" || rest[0] < '0' || rest[0] > '9'
}

// 64 goroutines make failing calls whose messages name a value of their own; each must read
// its own message, however the Go scheduler moves goroutines between OS threads. The
// library keeps a call's message per thread, so reading it on another thread than the call
// gives another goroutine's message (or none). The hook yields where a goroutine that is
// not locked to its thread would move most often, between the call and the message.
func TestMessagesSurviveGoroutineMigration(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(8))
	testHookBetweenCallAndMessage = runtime.Gosched
	defer func() { testHookBetweenCallAndMessage = nil }()
	const goroutines, iterations = 64, 200
	id, err := GetUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	var wrong sync.Map
	var wg sync.WaitGroup
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < iterations; i++ {
				var err error
				var want string
				if i%2 == 0 {
					nranks := -(1 + g*iterations + i)
					_, err = CommInitRank(nranks, id, 0, nil)
					want = fmt.Sprintf("nranks must be positive, got %d", nranks)
				} else {
					dtype := DataType(1000 + g*iterations + i)
					err = Gemm(0x1000, 0x1000, 0x1000, 1, 1, 8, dtype, 0)
					want = fmt.Sprintf("unknown datatype %d", int32(dtype))
				}
				var e *Error
				if !errors.As(err, &e) || !namesExactly(e.Message, want) {
					wrong.Store(fmt.Sprintf("goroutine %d call %d", g, i), fmt.Sprintf("want a message with %q, got %v", want, err))
				}
				runtime.Gosched()
			}
		}(g)
	}
	wg.Wait()
	n := 0
	wrong.Range(func(k, v any) bool {
		if n < 5 {
			t.Errorf("%s: %s", k, v)
		}
		n++
		return true
	})
	if n > 0 {
		t.Fatalf("%d of %d calls read another call's message", n, goroutines*iterations)
	}
}

func TestMoeOptionsStartFromTheInitializer(t *testing.T) {
	plain, err := MoeOptions{}.options()
	if err != nil {
		t.Fatal(err)
	}
	if plain.capacityPolicy != 0 || plain.expertCapacity != 0 || plain.activation != 0 || plain.reserved != 0 {
		t.Errorf("the zero MoeOptions give %+v, want the initializer's no-drop, no activation", plain)
	}
	if plain.magic == 0 || plain.version == 0 || plain.size == 0 {
		t.Errorf("size, magic and version must come from mkMoeOptionsInit, got %+v", plain)
	}
	for _, c := range []struct {
		in                           MoeOptions
		policy, capacity, activation int
	}{
		{MoeOptions{Activation: MoeActSilu}, 0, 0, 1},
		{MoeOptions{Activation: MoeActGelu, ExpertCapacity: 96}, 1, 96, 2},
		{MoeDropArgs{ExpertCapacity: 5}, 1, 5, 0},
	} {
		o, err := c.in.options()
		if err != nil {
			t.Fatal(err)
		}
		got := []int{int(o.capacityPolicy), int(o.expertCapacity), int(o.activation)}
		if want := []int{c.policy, c.capacity, c.activation}; !reflect.DeepEqual(got, want) {
			t.Errorf("%+v: policy, capacity, activation = %v, want %v", c.in, got, want)
		}
		if o.size != plain.size || o.magic != plain.magic || o.version != plain.version {
			t.Errorf("%+v: the header fields changed: %+v", c.in, o)
		}
	}
}
