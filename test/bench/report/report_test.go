package report

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const sample = `{"broker":"mosquitto","label":"qos0-fanin","scenario":"fanin","rate":100,"unit":"msgs/s","p50_us":10,"p99_us":20,"lost":0,"broker_cpu_us_per_op":4}
{"broker":"mochi","label":"qos0-fanin","scenario":"fanin","rate":50,"unit":"msgs/s","p50_us":30,"p99_us":40,"lost":2,"broker_cpu_us_per_op":8}

{"broker":"mosquitto","label":"qos0-fanin","scenario":"fanin","rate":300,"unit":"msgs/s","p50_us":12,"p99_us":22,"lost":1,"broker_cpu_us_per_op":2}
{"broker":"mochi","label":"qos0-fanin","scenario":"fanin","rate":70,"unit":"msgs/s","p50_us":30,"p99_us":40,"lost":0,"broker_cpu_us_per_op":10}
{"broker":"mosquitto","label":"storm","scenario":"storm","rate":5000,"unit":"connects/s"}
`

func TestSummarise_MediansAndSums(t *testing.T) {
	t.Parallel()
	rs, err := Read(strings.NewReader(sample))
	require.NoError(t, err)
	require.Len(t, rs, 5)
	sums := Summarise(rs)
	require.Len(t, sums, 3)
	require.Equal(t, "mosquitto", sums[0].Broker)
	require.InDelta(t, 200, sums[0].Rate, 1e-9)
	require.InDelta(t, 3, sums[0].CPUusPerOp, 1e-9)
	require.Equal(t, uint64(1), sums[0].Lost)
	require.Equal(t, "mochi", sums[1].Broker)
	require.InDelta(t, 60, sums[1].Rate, 1e-9)
	require.Equal(t, uint64(2), sums[1].Lost)
	require.Equal(t, "storm", sums[2].Label)
}

func TestWrite_Ratios(t *testing.T) {
	t.Parallel()
	rs, err := Read(strings.NewReader(sample))
	require.NoError(t, err)
	ratios, err := ParseRatios("mochi/mosquitto, keel/mosquitto")
	require.NoError(t, err)
	var out bytes.Buffer
	require.NoError(t, Write(&out, Summarise(rs), ratios))
	require.Contains(t, out.String(), "| qos0-fanin | 0.30× | 3.00× | n/a | n/a |")
	require.Contains(t, out.String(), "| storm | n/a | n/a | n/a | n/a |")
}

func TestParseRatios_Invalid(t *testing.T) {
	t.Parallel()
	_, err := ParseRatios("keel")
	require.Error(t, err)
}

func TestMedian(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		in   []float64
		want float64
	}{
		{"empty", nil, 0},
		{"odd", []float64{3, 1, 2}, 2},
		{"even", []float64{4, 1, 3, 2}, 2.5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.InDelta(t, tc.want, Median(tc.in), 1e-9)
		})
	}
}
