package wire

import (
	"bytes"
	"fmt"
	"io"
	"testing"
)

func BenchmarkAppendPublish(b *testing.B) {
	topic := []byte("bench/p/17")
	for _, size := range []int{64, 1024} {
		payload := make([]byte, size)
		for _, qos := range []byte{0, 1} {
			b.Run(fmt.Sprintf("msgSz=%db/qos=%d", size, qos), func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(size))
				buf := make([]byte, 0, 4096)
				for b.Loop() {
					buf = AppendPublish(buf[:0], topic, payload, qos, 1, false, false)
				}
			})
		}
	}
}

// BenchmarkReader_Publish measures splitting and decoding a stream of PUBLISH
// packets, the subscriber hot path of keel-bench.
func BenchmarkReader_Publish(b *testing.B) {
	for _, size := range []int{64, 1024} {
		b.Run(fmt.Sprintf("msgSz=%db", size), func(b *testing.B) {
			const batch = 1000
			var stream []byte
			for i := range batch {
				stream = AppendPublish(stream, []byte("bench/p/17"), make([]byte, size), 1, uint16(i+1), false, false)
			}
			src := bytes.NewReader(stream)
			r := NewReader(src, 64*1024, 0)
			b.ReportAllocs()
			b.SetBytes(int64(size))
			n := 0
			for b.Loop() {
				h, body, err := r.Next()
				if err == io.EOF {
					src.Reset(stream)
					h, body, err = r.Next()
				}
				if err != nil {
					b.Fatal(err)
				}
				if _, _, _, err := DecodePublish(h&0x0f, body); err != nil {
					b.Fatal(err)
				}
				n++
			}
			b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "msgs/s")
		})
	}
}
