package server

import (
	"errors"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/services/persistence/internal/store"
	"github.com/keelmq/keel/services/persistence/internal/store/boltstore"

	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

// FuzzDecodeBatch feeds arbitrary bytes through the Write request decoding
// and validation: it never panics, refuses only with [store.ErrInvalid], and
// what it accepts the store accepts too (or refuses for a stored-state
// reason), never with a panic.
func FuzzDecodeBatch(f *testing.F) {
	for _, op := range badOps() {
		b, _ := proto.Marshal(&persistencev1.WriteRequest{BatchId: 1, Ops: []*persistencev1.WriteOp{op}})
		f.Add(b)
	}
	for _, op := range []*persistencev1.WriteOp{activate(1), appendOp(1, 1, 2)} {
		b, _ := proto.Marshal(&persistencev1.WriteRequest{BatchId: 1, Ops: []*persistencev1.WriteOp{op}})
		f.Add(b)
	}
	d := decoder{lim: DefaultLimits}
	st, err := boltstore.Open(f.TempDir())
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = st.Close() })
	f.Fuzz(func(t *testing.T, b []byte) {
		var req persistencev1.WriteRequest
		if proto.Unmarshal(b, &req) != nil {
			return
		}
		ops, err := d.batch(&req)
		if err != nil {
			if !errors.Is(err, store.ErrInvalid) {
				t.Fatalf("decode error not ErrInvalid: %v", err)
			}
			return
		}
		for _, r := range store.Submit(t.Context(), st, ops)() {
			_ = r
		}
	})
}
