package mkernel

// The binding follows include/mkernel.h: cgo already checks every call it makes against the
// header's prototypes, so what can drift is what it does not call. Every function the
// header declares is called here, and every enumerator of the header's enums is a Go
// constant with the same name in its String table, in the header's order.

import (
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// headerPath is the repository's header, or MK_HEADER where the tests run elsewhere.
func headerPath() string {
	if p := os.Getenv("MK_HEADER"); p != "" {
		return p
	}
	return filepath.Join("..", "..", "..", "include", "mkernel.h")
}

func readHeader(t *testing.T) string {
	t.Helper()
	text, err := os.ReadFile(headerPath())
	if err != nil {
		t.Fatalf("reading the header (set MK_HEADER to its path): %v", err)
	}
	comments := regexp.MustCompile(`(?s)/\*.*?\*/|//[^\n]*`)
	return comments.ReplaceAllString(string(text), "")
}

// headerFunctions are the names of the functions the header declares.
func headerFunctions(header string) []string {
	proto := regexp.MustCompile(`(?m)^[A-Za-z_][\w \t\*]*?\b(mk\w+)\s*\(`)
	var names []string
	for _, m := range proto.FindAllStringSubmatch(header, -1) {
		names = append(names, m[1])
	}
	sort.Strings(names)
	return names
}

// bindingCalls are the header functions the package's sources call through cgo.
func bindingCalls(t *testing.T) map[string]bool {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	call := regexp.MustCompile(`\bC\.(mk[A-Z][A-Za-z0-9]*)\(`) // not the conversions C.mkDataType_t(...)
	calls := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range call.FindAllStringSubmatch(string(src), -1) {
			calls[m[1]] = true
		}
	}
	return calls
}

func TestEveryHeaderFunctionIsBound(t *testing.T) {
	header := readHeader(t)
	functions := headerFunctions(header)
	if len(functions) < 20 {
		t.Fatalf("found only %d functions in %s: %v", len(functions), headerPath(), functions)
	}
	calls := bindingCalls(t)
	for _, f := range functions {
		if !calls[f] {
			t.Errorf("%s is declared in mkernel.h but the Go binding never calls it", f)
		}
	}
	declared := map[string]bool{}
	for _, f := range functions {
		declared[f] = true
	}
	for c := range calls {
		if !declared[c] {
			t.Errorf("the Go binding calls %s, which mkernel.h does not declare", c)
		}
	}
}

// enumerators are the names of enum `name`'s enumerators, in the header's order.
func enumerators(t *testing.T, header, name string) []string {
	t.Helper()
	enum := regexp.MustCompile(`(?s)typedef enum\s*\{([^}]*)\}\s*` + name + `\s*;`)
	m := enum.FindStringSubmatch(header)
	if m == nil {
		t.Fatalf("no enum %s in the header", name)
	}
	var names []string
	for _, item := range strings.Split(m[1], ",") {
		if item = strings.TrimSpace(item); item != "" {
			names = append(names, strings.TrimSpace(strings.SplitN(item, "=", 2)[0]))
		}
	}
	return names
}

func TestEnumsMatchTheHeader(t *testing.T) {
	header := readHeader(t)
	if got, want := dataTypeNames[:], enumerators(t, header, "mkDataType_t"); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("DataType names %v, header mkDataType_t %v", got, want)
	}
	if got, want := redOpNames[:], enumerators(t, header, "mkRedOp_t"); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("RedOp names %v, header mkRedOp_t %v", got, want)
	}
	if got, want := scaleModeNames[:], enumerators(t, header, "mkScaleMode_t"); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("ScaleMode names %v, header mkScaleMode_t %v", got, want)
	}
	results := enumerators(t, header, "mkResult_t")
	if len(results) != len(resultNames) {
		t.Errorf("header mkResult_t has %d codes, the binding names %d", len(results), len(resultNames))
	}
	for i, name := range results {
		if resultNames[Result(i)] != name {
			t.Errorf("mkResult_t %d is %s in the header, %q in the binding", i, name, resultNames[Result(i)])
		}
	}
	for i := range dataTypeNames {
		if size := DataType(i).Size(); size == 0 {
			t.Errorf("%v has no size", DataType(i))
		}
	}
}
