package table

import (
	"testing"
)

// FuzzSet_Unmarshal: a stored route set read back from Olric (written by any
// router version, or damaged) either fails to decode or decodes to a set
// that re-encodes to a fixed point.
func FuzzSet_Unmarshal(f *testing.F) {
	var s Set
	s.Apply(Delta{Edge: "e1", Inc: 1, Seq: 1, Op: OpAdd, Route: Route{Filter: "a/b"}, Count: 2})
	s.Apply(Delta{Edge: "e2", Inc: 2, Seq: 9, Op: OpAdd, Route: Route{Filter: "a/#", Group: "g"}})
	b, err := s.Marshal()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	for _, seed := range []string{`{}`, `{"v":1,"r":null}`, `{"v":1,"r":[{"f":"a","e":[{"id":"x","i":1,"s":2},{"id":"x","i":3,"s":1}]}]}`,
		`{"v":1,"r":[{"f":"a","e":[]},{"f":"a","e":[{"id":"y"}]}]}`, `{"r":[{"f":"a","g":"g","e":[{"id":"","n":4294967295}]}]}`, `[1,2]`, `{"v":-1}`, ``} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := Unmarshal(b)
		if err != nil {
			return
		}
		b1, err := s.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		s1, err := Unmarshal(b1)
		if err != nil {
			t.Fatalf("re-encoded set does not decode: %v", err)
		}
		b2, err := s1.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if string(b1) != string(b2) {
			t.Fatalf("encoding not stable:\n%s\n%s", b1, b2)
		}
		// Applying to a decoded set never panics.
		s.Apply(Delta{Edge: "e1", Inc: 1, Seq: 5, Op: OpRemove, Route: Route{Filter: "a"}})
		s.Apply(Delta{Edge: "e1", Inc: 9, Seq: 1, Op: OpAdd, Route: Route{Filter: "a"}})
	})
}
