package mkernel

// #include <mkernel.h>
import "C"

import (
	"fmt"
	"runtime"
)

// Result is a library result code (mkResult_t). The non-success codes are also errors and
// serve as sentinels for errors.Is.
type Result int32

// The result codes, numbered as NCCL numbers ncclResult_t.
const (
	Success            Result = C.mkSuccess
	UnhandledCudaError Result = C.mkUnhandledCudaError
	SystemError        Result = C.mkSystemError
	InternalError      Result = C.mkInternalError
	InvalidArgument    Result = C.mkInvalidArgument
	InvalidUsage       Result = C.mkInvalidUsage
	RemoteError        Result = C.mkRemoteError
	InProgress         Result = C.mkInProgress
	Timeout            Result = C.mkTimeout
)

var resultNames = map[Result]string{
	Success:            "mkSuccess",
	UnhandledCudaError: "mkUnhandledCudaError",
	SystemError:        "mkSystemError",
	InternalError:      "mkInternalError",
	InvalidArgument:    "mkInvalidArgument",
	InvalidUsage:       "mkInvalidUsage",
	RemoteError:        "mkRemoteError",
	InProgress:         "mkInProgress",
	Timeout:            "mkTimeout",
}

// String is the C name of the code ("mkInvalidArgument"), or "mkResult_t(n)".
func (r Result) String() string {
	if name, ok := resultNames[r]; ok {
		return name
	}
	return fmt.Sprintf("mkResult_t(%d)", int32(r))
}

// Error is the library's description of the code (mkGetErrorString).
func (r Result) Error() string {
	return C.GoString(C.mkGetErrorString(C.mkResult_t(r)))
}

// Error is a failed call: the function, its result code, and the detailed message
// (mkGetLastError, which names the function and the rule that was broken).
type Error struct {
	Op      string // the C function, e.g. "mkCommInitRank"
	Code    Result
	Message string
}

func (e *Error) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("mkernel: %s: %s (%s)", e.Op, e.Code.Error(), e.Code.String())
	}
	return fmt.Sprintf("mkernel: %s (%s)", e.Message, e.Code.String())
}

// Is makes errors.Is(err, mkernel.InvalidArgument) true for an *Error with that code.
func (e *Error) Is(target error) bool {
	code, ok := target.(Result)
	return ok && code == e.Code
}

// call runs one library call and, if it fails, reads its message on the same OS thread:
// the library keeps the message of a call without a communicator per thread, and a
// goroutine may move to another thread between two cgo calls. comm is the communicator
// the call was made on (nil for none): its message is read from it.
func call(op string, comm C.mkComm_t, f func() C.mkResult_t) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r := f()
	if r == C.mkSuccess {
		return nil
	}
	if testHookBetweenCallAndMessage != nil {
		testHookBetweenCallAndMessage()
	}
	msg := C.GoString(C.mkGetLastError(comm))
	if msg == "" && comm != nil {
		msg = C.GoString(C.mkGetLastError(nil))
	}
	return &Error{Op: op, Code: Result(r), Message: msg}
}

// testHookBetweenCallAndMessage, when set by a test, runs where an unlocked goroutine could
// move to another OS thread: between a failed call and the read of its message.
var testHookBetweenCallAndMessage func()

// argumentError is an argument the binding rejects before calling the library (a negative
// size, a value that does not fit its C type), reported as the library reports its own.
func argumentError(op, format string, args ...any) error {
	return &Error{Op: op, Code: InvalidArgument, Message: op + ": " + fmt.Sprintf(format, args...)}
}
